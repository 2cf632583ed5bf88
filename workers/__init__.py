"""pagedray.workers"""

"""pagedray.deploy"""

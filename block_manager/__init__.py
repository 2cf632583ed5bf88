"""pagedray.block_manager"""

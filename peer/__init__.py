"""peer"""

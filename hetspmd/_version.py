"""The installed version of hetspmd."""
__version__ = "0.1.0"

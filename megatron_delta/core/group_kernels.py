"""Stub."""
def library(choice):
    return None

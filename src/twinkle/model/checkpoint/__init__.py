"""Saved weights and training state: the files (written so a crash leaves no half-written one), who writes them over a
mesh, and exports other tools load.
"""

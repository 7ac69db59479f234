"""What the user asks for, checked before any process works: meshes, training runs, errors.

Pure Python, no torch: the notebook side imports it freely.
"""

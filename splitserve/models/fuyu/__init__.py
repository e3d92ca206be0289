"""Fuyu: model.py (patch projection, Persimmon decoder), processor.py (the front's patch grids and
prompt layout). Empty on purpose: importing the processor must not import the model."""

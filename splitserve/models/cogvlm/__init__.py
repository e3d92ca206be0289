"""CogVLM: model.py (EVA2-CLIP, visual-expert decoder), processor.py (the front's image transform and
prompt hooks), config.py (its config.json). Empty on purpose: importing the processor or the config
reader must not import the model."""

"""The train stage: a plain, readable AMP training loop (see ``loop.py``) and its pipeline entry (``stage.py``)."""

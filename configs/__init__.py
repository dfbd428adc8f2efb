"""ml_collections recipes: `python -m train --config configs/<recipe>.py --workdir DIR`."""

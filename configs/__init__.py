"""ml_collections recipes.

    python -m transformer_zoo.train --config configs/<recipe>.py --workdir DIR
"""

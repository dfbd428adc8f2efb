"""Logical axis names, declared once.

Every parameter and key activation in models/ is annotated with these names
(flax.linen partitioning). train/parallel.py maps them to mesh axes with rules
from the run config, so sharding never requires touching model code.
"""

BATCH = "batch"
LENGTH = "length"  # sequence positions (activations) and learned position tables
EMBED = "embed"  # d_model
HEADS = "heads"  # query heads N
KV_HEADS = "kv_heads"  # key/value heads K (GQA/MQA)
HEAD_DIM = "kv"  # per-head feature H
MLP = "mlp"  # FFN hidden F
VOCAB = "vocab"  # V
CLASSES = "classes"  # classification head outputs

ALL = (BATCH, LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB, CLASSES)

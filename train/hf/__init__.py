"""Published Hugging Face checkpoints in and out: BERT, GPT-2 and Marian.

    from transformer_zoo.train import hf
    converted = hf.read_hf("all-MiniLM-L6-v2/")       # family, ModelConfig, params, tokenizer
    hf.write_hf(converted, "exported/")              # config.json + model.safetensors
    hf.from_hf("opus-mt-en-de/", "runs/opus")        # a workdir load_run and train.decode read
    hf.to_hf("runs/opus", "opus-exported/")

Weights are read and written with safetensors and numpy (no torch needed);
the command is `python -m transformer_zoo.train.convert`.
"""

from transformer_zoo.train.hf.convert import ARCHITECTURES, Converted, read_hf, write_hf
from transformer_zoo.train.hf.weights import ConversionError
from transformer_zoo.train.hf.workdir import from_hf, read_workdir, to_hf, write_workdir

__all__ = ["ARCHITECTURES", "ConversionError", "Converted", "from_hf", "read_hf",
           "read_workdir", "to_hf", "write_hf", "write_workdir"]

"""The install provides one import root, transformer_zoo, and nothing that can shadow
a user's own top-level `models`, `data`, `train` or `configs` packages."""

import subprocess
import sys
import textwrap

USER_PACKAGES = ("models", "data", "train", "configs")


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_zoo_works_beside_a_users_own_models_data_train_configs(tmp_path):
    for name in USER_PACKAGES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"OWNER = 'user {name}'\n")
    proc = _run("""
        import jax, jax.numpy as jnp
        import models, data, train, configs
        from transformer_zoo.models import MultiHeadAttention, ModelConfig, DecoderOnly
        from transformer_zoo.data import CharTokenizer
        from transformer_zoo.train import make_optimizer
        from transformer_zoo.configs import common
        from transformer_zoo.train.predict import load_run
        assert [m.OWNER for m in (models, data, train, configs)] == [
            'user models', 'user data', 'user train', 'user configs'], 'shadowed'
        x = jnp.ones((2, 5, 16))
        mha = MultiHeadAttention(num_heads=4, position_encoding='rope')
        y = mha.apply(mha.init(jax.random.key(0), x), x)
        lm = DecoderOnly(ModelConfig(vocab_size=16, d_model=16, num_heads=2, d_ff=32,
                                     num_decoder_layers=1))
        ids = jnp.ones((1, 4), jnp.int32)
        logits = lm.apply(lm.init(jax.random.key(0), ids), ids)
        assert common.base_config().optim.name
        print(y.shape, logits.shape)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "(2, 5, 16) (1, 4, 16)"


def test_no_bare_top_level_package_is_installed(tmp_path):
    proc = _run(f"""
        import importlib.util, sys
        sys.path = [p for p in sys.path if p not in ('', '.')]
        print([n for n in {USER_PACKAGES!r} if importlib.util.find_spec(n) is not None])
        import transformer_zoo.models as m
        print(m.__name__)
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["[]", "transformer_zoo.models"]

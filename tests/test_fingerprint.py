"""The model fingerprint that keys cached LogicGraphs (pure: no process group, no trace): it must change
whenever a trace could, and stay put when only the weights' values do."""
import importlib
import os
import sys
import textwrap
import time

import torch

from hotswitch.compiler.fingerprint import model_fingerprint as _fingerprint
from hotswitch.models import build_hf_model, build_model


def model_fingerprint(model, example_inputs) -> str:
    fp = _fingerprint(model, example_inputs)
    assert fp.persistent  # every model here has its code in a file
    return fp.digest


IDS = torch.zeros(2, 8, dtype=torch.long)


def _gpt(**overrides):
    return build_model("gpt-tiny", vocab_size=101, **overrides)


def test_weights_do_not_matter_but_shapes_settings_and_mode_do():
    torch.manual_seed(0)
    a = _gpt()
    torch.manual_seed(1)
    b = _gpt()
    assert model_fingerprint(a, (IDS, IDS)) == model_fingerprint(b, (IDS, IDS))
    assert model_fingerprint(a, (IDS, IDS)) != model_fingerprint(_gpt(n_layers=3), (IDS, IDS))  # state shapes
    assert model_fingerprint(a, (IDS, IDS)) != model_fingerprint(a, (IDS[:, :4], IDS[:, :4]))  # example shapes
    assert model_fingerprint(a, (IDS, IDS)) != model_fingerprint(a, (IDS.int(), IDS))  # example dtypes
    before = model_fingerprint(a, (IDS, IDS))
    a.eval()  # dropout and the like trace differently
    assert model_fingerprint(a, (IDS, IDS)) != before
    a.train()
    a.layers[0].attn.eps_for_test = 1e-5  # any plain setting of any module
    assert model_fingerprint(a, (IDS, IDS)) != before


def test_hf_config_and_keyword_structure_count():
    llama = build_hf_model("llama", vocab_size=101).model  # the Hugging Face model itself, called by keyword
    kwargs = dict(input_ids=IDS, labels=IDS)
    base = model_fingerprint(llama, kwargs)
    assert model_fingerprint(llama, dict(input_ids=IDS, attention_mask=IDS)) != base  # other input names
    llama.config.attention_dropout = 0.5  # a setting held in the HF config, which forward reads
    assert model_fingerprint(llama, kwargs) != base


def _load(tmp_path, name, files):
    """Import package `name` written from `files` (file name -> source), fresh."""
    pkg = tmp_path / name
    pkg.mkdir(exist_ok=True)
    for f, src in files.items():
        (pkg / f).write_text(textwrap.dedent(src))
    sys.path.insert(0, str(tmp_path))
    try:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
        importlib.invalidate_caches()
        return importlib.import_module(f"{name}.model")
    finally:
        sys.path.remove(str(tmp_path))


MODEL = """
    import torch
    from .helpers import act

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return act(self.lin(x)).sum()
"""


def test_edited_code_changes_it_even_in_a_helper_module(tmp_path):
    x = torch.zeros(2, 8)
    v1 = _load(tmp_path, "usermodel", {"__init__.py": "", "model.py": MODEL,
                                       "helpers.py": "import torch\nact = torch.relu\n"})
    first = model_fingerprint(v1.Net(), (x,))
    assert model_fingerprint(v1.Net(), (x,)) == first  # stable while nothing changes
    helpers = tmp_path / "usermodel" / "helpers.py"
    helpers.write_text("import torch\nact = torch.tanh\n")  # the model's file is untouched
    stamp = time.time() + 5
    os.utime(helpers, (stamp, stamp))  # a coarse file clock must still see the edit
    v2 = _load(tmp_path, "usermodel", {})
    assert model_fingerprint(v2.Net(), (x,)) != first
    # the same class name and shapes in another package: another model
    other = _load(tmp_path, "othermodel", {"__init__.py": "", "model.py": MODEL,
                                           "helpers.py": "import torch\nact = torch.relu\n"})
    assert model_fingerprint(other.Net(), (x,)) != first


def test_a_class_without_readable_source_is_not_cached_on_disk():
    namespace = {}
    exec("import torch\nclass Typed(torch.nn.Module):\n    def forward(self, x):\n        return x.sum()\n", namespace)
    namespace["Typed"].__module__ = "hotswitch_no_such_module"  # as a class typed at a `python` prompt
    fp = _fingerprint(namespace["Typed"](), (torch.zeros(2, 3),))
    assert not fp.persistent and len(fp.digest) == 64

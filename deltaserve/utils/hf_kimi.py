"""transformers' Kimi Linear model (the parity oracle of the tests and the baseline of `bench offline`), imported so
that it runs its own pure-PyTorch KDA.

transformers' `modeling_kimi_linear` decides when it is imported whether its KDA calls fla's Triton kernels: it uses
them whenever `fla` imports, and fla-core comes with the `kernels` extra. On a CPU those kernels fail ("0 active
drivers") or, under `TRITON_INTERPRET=1`, run in the interpreter; on a GPU they are fla's, not an independent oracle.
So the module is imported once with `fla` hidden (a failed import makes transformers fall back to torch), and fla is
restored for everyone else.
"""

from __future__ import annotations

import sys
from typing import Any

MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"


def kimi_linear_for_causal_lm() -> Any:
    """`transformers.KimiLinearForCausalLM`, its module imported without fla if this is the first import (a module
    imported earlier, with fla, is returned as it is). ImportError when transformers is not installed."""
    if MODULE not in sys.modules:
        saved = {name: module for name, module in sys.modules.items() if name == "fla" or name.startswith("fla.")}
        for name in saved:
            del sys.modules[name]
        sys.modules["fla"] = None  # type: ignore[assignment]  # `import fla` raises ImportError
        try:
            import importlib

            importlib.import_module(MODULE)
        finally:
            del sys.modules["fla"]
            sys.modules.update(saved)
    import transformers

    return transformers.KimiLinearForCausalLM

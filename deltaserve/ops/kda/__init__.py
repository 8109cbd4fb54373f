"""KDA ops (model-spec §3): the only names layers call, dispatched through `deltaserve.ops.dispatch`. CPU prefills
with fp32 / bf16 activations take the factorised chunked backend (`cpu.py`), CPU decodes the one-read update
(`cpu_decode.py`); everything else runs the pure-PyTorch reference."""

from deltaserve.ops import dispatch
from deltaserve.ops.kda import cpu, cpu_decode, ref

kda_gate = dispatch.op("kda_gate", ref.kda_gate)
kda_prefill = dispatch.op("kda_prefill", ref.kda_prefill)
kda_decode = dispatch.op("kda_decode", ref.kda_decode)
dispatch.register("kda_prefill", dispatch.Backend("cpu", cpu.kda_prefill, supports=cpu.supports))
dispatch.register("kda_decode", dispatch.Backend("cpu", cpu_decode.kda_decode, supports=cpu_decode.supports))

__all__ = ["kda_decode", "kda_gate", "kda_prefill"]

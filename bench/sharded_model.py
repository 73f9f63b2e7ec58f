"""Per-device memory and communication of one microbatched step, as formulas.

The cost model of docs/multi_device.md ("What it costs: the model", with its table of
formulas): for each way ``DataParallel(mesh=...)`` reduces a gradient, what one device
holds and sends (a ring's bytes, as ``Collective.bytes_sent`` counts them) in one step
of ``K`` microbatches; what scales with the parameters only. With a tensor axis, the
collectives over the data axes first gather their operand over it, as JAX 0.10
compiles them (``Layout.tensor_split_kept=False``). tests/test_cost_model.py holds the
formulas to the compiled step. ``python bench/sharded_model.py`` prints the
documentation's projection to 1B, 7B and 70B parameters.
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

MODES = ("data parallel", "fsdp", "gather once", "hsdp", "fsdp x tensor")


class Layout(NamedTuple):
  """One step's shape: parameters, devices, microbatches and byte widths."""

  params: int  # P, parameters (elements)
  data: int  # D, devices on the data axes
  # R, of those the replicas (HSDP): the parameters sharded over D / R. Ignored by
  # "data parallel" (R = D) and the FSDP modes (R = 1).
  replicas: int = 1
  tensor: int = 1  # T, devices on a tensor axis (the parameters split over it too)
  microbatches: int = 1  # K
  param_bytes: int = 4  # p
  accumulator_bytes: int = 4  # a
  gather_bytes: int | None = None  # g; None: p
  reduce_bytes: int | None = None  # r; None: the gradient's (g for gathered leaves, else p)
  # Whether collectives over the data axes keep the tensor split (False: they gather
  # over the tensor axis first, as JAX 0.10 compiles them).
  tensor_split_kept: bool = False


class Cost(NamedTuple):
  """What one device holds and sends in one step (bytes)."""

  param: int  # its shard of the parameters (an argument of the step)
  gathered: int  # the parameters gathered for fun, alive for the whole loop
  accumulator: int  # the float32 sums
  in_flight: int  # at most: one microbatch's local gradient before it is reduced
  output: int  # the gradient returned, sharded as the parameters
  sent_before: int  # before the loop (the gather)
  sent_per_microbatch: int  # in each iteration of the loop
  sent_after: int  # after the loop
  microbatches: int

  @property
  def sent_per_step(self) -> int:
    return self.sent_before + self.microbatches * self.sent_per_microbatch + self.sent_after


def shards(mode: str, layout: Layout) -> tuple[int, int]:
  """``(F, R)``: the data devices the parameters are sharded over and replicated over."""
  if mode not in MODES:
    raise ValueError(f"mode={mode!r} is not one of {MODES}.")
  d = layout.data
  if mode == "data parallel":
    return 1, d
  if mode == "hsdp":
    if d % layout.replicas:
      raise ValueError(f"replicas={layout.replicas} must divide data={d} devices.")
    return d // layout.replicas, layout.replicas
  return d, 1


def cost(mode: str, layout: Layout) -> Cost:
  """The per-device :class:`Cost` of one step in ``mode`` (one of :data:`MODES`).

  ``"fsdp x tensor"`` is FSDP with ``layout.tensor`` > 1; ``"fsdp"`` with
  ``tensor=1`` is the plain case.
  """
  f, r = shards(mode, layout)
  q = layout.params // layout.tensor
  p, a = layout.param_bytes, layout.accumulator_bytes
  g = layout.gather_bytes or p
  sharded = f > 1
  grad_bytes = g if sharded else p
  red = layout.reduce_bytes or grad_bytes
  per_microbatch = sharded and mode != "gather once"
  t = layout.tensor
  # What a collective over the data axes sees of a leaf: its tensor shard, or
  # (the split not kept) the whole of it, gathered over the tensor axis first.
  seen = q if t == 1 or layout.tensor_split_kept else layout.params
  gather_first = 0 if seen == q else (t - 1) * seen * g // (t * f)
  scatter_first = 0 if seen == q else (t - 1) * seen * red // t
  ring = (f - 1) * seen * red // f if sharded else 0  # one reduce-scatter of the local gradient
  after = 0 if per_microbatch else ring + (scatter_first if sharded else 0)
  if r > 1:
    after += 2 * (r - 1) * (q // f) * red // r
  return Cost(
      param=q * p // f,
      gathered=q * g if sharded else 0,
      accumulator=q * a // f if per_microbatch else q * a,
      in_flight=seen * grad_bytes,
      output=q * p // f,
      sent_before=(f - 1) * seen * g // f + gather_first if sharded else 0,
      sent_per_microbatch=ring + scatter_first if per_microbatch else 0,
      sent_after=after,
      microbatches=layout.microbatches,
  )


# The projection's assumptions: an H100 SXM's dense bfloat16 peak at a sustained
# 40%, and the bandwidth one GPU sends at in a ring: NVLink inside a node of 8,
# one 400 Gb/s InfiniBand port per GPU between nodes. Assumptions, not measurements.
ASSUMED_FLOPS = 0.4 * 989e12
ASSUMED_BANDWIDTH = {"NVLink (8 GPUs, one node)": 450e9, "InfiniBand (400 Gb/s per GPU)": 50e9}


def hiding_tokens(reduce_bytes: int, data: int, bandwidth: float,
                  flops: float = ASSUMED_FLOPS) -> float:
  """Tokens per device per microbatch at which its reduce-scatter takes no longer
  than its compute (6 FLOPs per parameter per token, forward and backward):
  ``(D-1)/D Q r / bandwidth <= 6 Q tokens / flops``. ``Q`` cancels."""
  return (data - 1) / data * reduce_bytes * flops / (6 * bandwidth)


def _gib(x: float) -> str:
  return f"{x / 2**30:,.1f}"


PROJECTED = (*MODES, "fsdp x tensor, split kept")


def projected_layout(mode: str, params: float, devices: int, microbatches: int) -> Layout:
  """The layout of one cell of the projection: ``devices`` in all, float32
  parameters and accumulator. The FSDP modes gather and reduce in bfloat16
  (``gather_dtype``, ``reduce_dtype``); data parallel reduces its float32 sums.
  HSDP: FSDP over 8 devices (a node), replicated over the rest; FSDP x tensor:
  ``T = 4``, the data axis the other ``devices / 4``."""
  tensor = 4 if mode.startswith("fsdp x tensor") else 1
  low = None if mode == "data parallel" else 2
  return Layout(
      params=int(params), data=devices // tensor, replicas=max(devices // 8, 1),
      tensor=tensor, microbatches=microbatches, gather_bytes=low, reduce_bytes=low,
      tensor_split_kept=mode.endswith("split kept"),
  )


def projection(sizes: tuple[float, ...] = (1e9, 7e9, 70e9),
               devices: tuple[int, ...] = (8, 64, 256), microbatches: int = 8) -> str:
  """A markdown table, per device: parameters (shard and gathered) + accumulator,
  and bytes sent per step, in GiB, per mode (see :func:`projected_layout`)."""
  rows = []
  for size in sizes:
    for d in devices:
      cells = []
      for mode in PROJECTED:
        if mode == "hsdp" and d <= 8:
          cells.append("(= fsdp)")
          continue
        c = cost(mode.removesuffix(", split kept"), projected_layout(mode, size, d, microbatches))
        cells.append(f"{_gib(c.param + c.gathered)} + {_gib(c.accumulator)};"
                     f" {_gib(c.sent_per_step)}")
      rows.append([f"{size / 1e9:g}B", str(d), *cells])
  header = ["P", "devices", *PROJECTED]
  lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * len(PROJECTED)]
  lines += ["| " + " | ".join(row) + " |" for row in rows]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--microbatches", type=int, default=8)
  args = parser.parse_args(argv)
  print(f"Per device, GiB: parameters (shard + gathered) + accumulator; sent per step."
        f" K = {args.microbatches}")
  print(projection(microbatches=args.microbatches))
  print()
  for name, bandwidth in ASSUMED_BANDWIDTH.items():
    for r, dtype in ((2, "bfloat16"), (4, "float32")):
      print(f"{name}, reduce in {dtype}: a reduce-scatter per microbatch hides behind its"
            f" compute from {hiding_tokens(r, 64, bandwidth):,.0f} tokens per device per"
            " microbatch (D = 64)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Sharded parameters: per-device memory, collectives and step time against N.

On 8 CPU devices (set before jax is imported), a tanh MLP (``--activation relu``) of 4
float32 weights of 1024 x 1024 and a batch of 256 rows sharded over the data axes, for
each N side by side: the hand-written scan (microbatch ``i`` rows ``i, i + N, ...``, the
gradient carry constrained to the parameters' shardings: the reference), the same with
the activations constrained, a hand-written ``shard_map`` (``psum_scatter``), and
``accum_jax.value_and_grad`` with ``DataParallel(mesh, param_sharding=...)``, with
``gather="once"``, without ``param_sharding``, without a mesh (``split="strided"``) and
with replicated parameters; FSDP on 8 devices for every N, and at ``--layout-n`` HSDP
(replica 2, fsdp 4) and FSDP x tensor (data 4, model 2). Per device: XLA's
``memory_analysis()``, the while loop's carry (what it updates: the accumulator), the
collectives per microbatch and outside the loop with the bytes a ring sends, the step
time (interleaved rounds), and the gradient's deviation from one device's.
``loop_carry`` and ``explicit_groups`` are read by tests/test_cost_model.py too.

Run from the repository root::

  python bench/bench_sharded.py            # full run, about 10 minutes on 2 busy CPU cores
  python bench/bench_sharded.py --quick    # smoke run: a small model, N in 1 and 4 (~35 s)
"""

from __future__ import annotations

import os

# Eight CPU devices; must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse
import collections
import dataclasses
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
from _common import (
    environment,
    markdown_table,
    memory_analysis_dict,
    quartiles,
    time_interleaved,
    write_json,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax.testing import collectives

HAND = "hand-written scan"
HAND_ACT = "hand-written scan, activations constrained"
SHARD_MAP = "hand-written shard_map"
FSDP = "accum_jax"
ONCE = "accum_jax gather='once'"
AUTO = "accum_jax, no param_sharding"
STRIDED = "accum_jax, no mesh, strided"
DP = "accum_jax, replicated parameters"
METHODS = (HAND, HAND_ACT, SHARD_MAP, FSDP, ONCE, AUTO, STRIDED, DP)
LAYOUT_METHODS = (HAND, HAND_ACT, SHARD_MAP, FSDP, ONCE)  # for HSDP and FSDP x tensor

# name -> (mesh shape, mesh axes, data axes, weight i's spec, and the spec a
# sharding-aware model gives its activations after layer i: rows over the data axes,
# features over the tensor axis after a column split).
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...], Any, Any]] = {
    "fsdp": ((8,), ("data",), ("data",), lambda i: P("data", None), lambda i: P("data", None)),
    "hsdp": ((2, 4), ("replica", "fsdp"), ("replica", "fsdp"), lambda i: P("fsdp", None),
             lambda i: P(("replica", "fsdp"), None)),
    "fsdp x tensor": ((4, 2), ("data", "model"), ("data",),
                      lambda i: P("data", "model") if i % 2 == 0 else P("model", "data"),
                      lambda i: P("data", "model") if i % 2 == 0 else P("data", None)),
}
_MIB = 2**20
_KINDS = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
          "collective-permute": "CP"}


class Problem(NamedTuple):
  """One layout's mesh, shardings, arguments and reference."""

  layout: str
  mesh: Any
  data_axes: tuple[str, ...]
  specs: dict[str, P]  # each weight's spec
  act: Callable[[int], P] | None  # activation spec after layer i, for automatic modes
  sharded: tuple[Any, Any]  # (parameters, batch), placed
  replicated: tuple[Any, Any]  # the parameters replicated, the batch as above
  reference: Any  # (value, grads) of the full batch on one device


# The hidden layers' nonlinearity (--activation). It changes the hand-written scan's
# program: with tanh XLA reduce-scatters each microbatch's gradient into the carry;
# with ReLU it all-reduces the whole gradient and slices it (a full-size temporary).
ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu}
activation = ACTIVATIONS["tanh"]


def loss_fn(params: Any, batch: Any, act: Callable[[int], Any] | None = None) -> jax.Array:
  """MSE of an MLP; ``act(i)``, if given, constrains the activations after layer i."""
  h = batch["x"]
  num_layers = len(params)
  for i in range(num_layers):
    h = h @ params[f"w{i}"]
    if act is not None:
      h = jax.lax.with_sharding_constraint(h, act(i))
    if i < num_layers - 1:
      h = activation(h)
  return jnp.mean((h - batch["y"]) ** 2)


def make_problem(layout: str, width: int, num_layers: int, batch_size: int) -> Problem:
  shape, names, data_axes, weight_spec, act_spec = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  rng = np.random.default_rng(0)
  params = {f"w{i}": (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
            for i in range(num_layers)}
  batch = {"x": rng.standard_normal((batch_size, width)).astype(np.float32),
           "y": rng.standard_normal((batch_size, width)).astype(np.float32)}
  specs = {f"w{i}": weight_spec(i) for i in range(num_layers)}
  placed_batch = jax.device_put(batch, NamedSharding(mesh, P(data_axes)))
  sharded = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in specs.items()})
  replicated = jax.device_put(params, NamedSharding(mesh, P()))
  reference = jax.jit(jax.value_and_grad(loss_fn))(params, batch)

  def act(i):
    return NamedSharding(mesh, act_spec(i))

  return Problem(layout, mesh, data_axes, specs, act, (sharded, placed_batch),
                 (replicated, placed_batch), jax.device_get(reference))


def hand_written_scan(
    problem: Problem, n: int, constrain_activations: bool = False
) -> Callable[..., Any]:
  """The sharded accumulation MaxText and Levanter write: a ``lax.scan`` under ``jax.jit``,
  the gradient carry constrained to the parameters' shardings; ``constrain_activations``:
  the model's activations' rows constrained to the data axes too, as a sharding-aware
  model does (XLA then all-reduces each microbatch's whole gradient on the CPU)."""
  act = problem.act if constrain_activations else None
  mesh = problem.mesh
  shardings = {k: NamedSharding(mesh, s) for k, s in problem.specs.items()}
  by_microbatch = NamedSharding(mesh, P(None, problem.data_axes))

  def constrain(tree):
    return jax.lax.with_sharding_constraint(tree, shardings)

  def step(params, batch):
    def split(x):  # microbatch i: rows i, i + n, ...: a slice of every device's rows
      x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
      return jax.lax.with_sharding_constraint(x, by_microbatch)

    def body(carry, microbatch):
      total, grads = carry
      value, g = jax.value_and_grad(loss_fn)(params, microbatch, act)
      return (total + value, constrain(jax.tree.map(jnp.add, grads, g))), None

    zeros = constrain(jax.tree.map(jnp.zeros_like, params))
    (total, grads), _ = jax.lax.scan(body, (jnp.float32(0), zeros), jax.tree.map(split, batch))
    return total / n, jax.tree.map(lambda g: g / n, grads)

  return jax.jit(step)


def _data_dims(spec: P, data_axes: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
  dims = []
  for dim, entry in enumerate(spec):
    names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    if over := tuple(a for a in names if a in data_axes):
      dims.append((dim, over))
  return dims


def hand_written_shard_map(problem: Problem, n: int) -> Callable[..., Any]:
  """FSDP written with explicit collectives: in ``shard_map`` over the data axes,
  the shards gathered, each microbatch's gradient reduce-scattered into a shard."""
  axes = problem.data_axes
  mesh = problem.mesh
  local = {k: P(*(e if e in axes else None for e in s)) for k, s in problem.specs.items()}
  dims = {k: _data_dims(s, axes) for k, s in local.items()}
  replicas = {k: tuple(a for a in axes if all(a not in o for _, o in dims[k])) for k in dims}
  devices = int(np.prod([mesh.shape[a] for a in axes]))

  def per_device(params, batch):
    full = dict(params)
    for k, over in dims.items():
      for dim, names in over:
        full[k] = jax.lax.all_gather(full[k], names, axis=dim, tiled=True)
    microbatches = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)

    def body(carry, microbatch):
      total, acc = carry
      value, g = jax.value_and_grad(loss_fn)(full, microbatch)
      for k, over in dims.items():
        for dim, names in reversed(over):
          g[k] = jax.lax.psum_scatter(g[k], names, scatter_dimension=dim, tiled=True)
      return (total + value, jax.tree.map(jnp.add, acc, g)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (total, acc), _ = jax.lax.scan(body, (jnp.float32(0), zeros), microbatches)
    acc = {k: jax.lax.psum(a, replicas[k]) if replicas[k] else a for k, a in acc.items()}
    scale = 1.0 / (n * devices)
    return jax.lax.psum(total, axes) * scale, jax.tree.map(lambda a: a * scale, acc)

  return jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=(local, P(axes)), out_specs=(P(), local),
      axis_names=set(axes), check_vma=False,
  ))


def build(method: str, problem: Problem, n: int) -> tuple[Callable[..., Any], tuple[Any, Any]]:
  """The jitted step of ``method`` at ``n`` microbatches, and its arguments."""
  axes = problem.data_axes
  data_axis = axes[0] if len(axes) == 1 else axes
  on_mesh = accum_jax.DataParallel(mesh=problem.mesh, data_axis=data_axis)
  if method in (HAND, HAND_ACT):
    return hand_written_scan(problem, n, method == HAND_ACT), problem.sharded
  if method == SHARD_MAP:
    return hand_written_shard_map(problem, n), problem.sharded
  if method in (FSDP, ONCE):
    gather = "once" if method == ONCE else "per_microbatch"
    vg = accum_jax.value_and_grad(loss_fn, n, data_parallel=dataclasses.replace(
        on_mesh, param_sharding=problem.specs, gather=gather))
    return jax.jit(vg), problem.sharded
  if method == AUTO:
    return jax.jit(accum_jax.value_and_grad(loss_fn, n, data_parallel=on_mesh)), problem.sharded
  if method == STRIDED:
    def strided(params, batch):
      return accum_jax.value_and_grad(loss_fn, n,
          data_parallel=accum_jax.DataParallel(split="strided"))(params, batch)
    return jax.jit(strided), problem.sharded
  if method == DP:
    return jax.jit(accum_jax.value_and_grad(loss_fn, n, data_parallel=on_mesh)), problem.replicated
  raise ValueError(f"method={method!r} is not one of {METHODS}.")


_ARRAY = re.compile(r"\b(f16|bf16|f32|f64)\[([\d,]+)\]")
_WIDTH = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}


def _split_top(text: str) -> list[str]:
  """The comma-separated items of a tuple's inside, at nesting depth 0."""
  items, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      items.append(text[start:i].strip())
      start = i + 1
  items.append(text[start:].strip())
  return items


class Carry(NamedTuple):
  """Float arrays of rank >= 2 in the outermost while loop's carry, by role."""

  updated_bytes: int  # changed by every iteration: the accumulator
  updated_shapes: tuple[str, ...]
  passed_bytes: int  # passed on unchanged: gathered parameters, the batch
  passed_shapes: tuple[str, ...]


def loop_carry(hlo_text: str) -> Carry | None:
  """What the compiled module's largest while loop carries; None without a loop.

  An element of the carry is "passed" where the body's root tuple returns it
  unchanged (``get-tuple-element`` of the body's parameter at the same index).
  """
  lines = hlo_text.splitlines()
  loops = []
  for line in lines:
    m = re.search(r"=\s*\((.*)\)\s+while\(.*body=%?([\w.\-]+)", line)
    if m:
      loops.append((_split_top(re.sub(r"/\*index=\d+\*/", "", m.group(1))), m.group(2)))
  if not loops:
    return None
  shapes, body = max(loops, key=lambda x: len(x[0]))
  root, param, defs = None, None, {}
  inside = False
  for line in lines:
    if re.match(rf"^%?{re.escape(body)}\s", line):
      inside = True
      continue
    if inside:
      if line.startswith("}"):
        break
      m = re.match(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
      if not m:
        continue
      defs[m.group(2)] = m.group(3)
      if "parameter(0)" in m.group(3):
        param = m.group(2)
      if m.group(1):
        root = re.sub(r"/\*index=\d+\*/", "", m.group(3))
  passed = set()
  if root is not None and param is not None:
    operands = _split_top(root[root.index("tuple(") + len("tuple("): root.rindex(")")])
    for i, operand in enumerate(operands):
      d = defs.get(operand.lstrip("%").split()[-1].lstrip("%"), "")
      if re.search(rf"get-tuple-element\(%?{re.escape(param)}\), index={i}\b", d):
        passed.add(i)
  updated, kept = [], []
  for i, shape in enumerate(shapes):
    m = _ARRAY.match(shape)
    if not m or len(m.group(2).split(",")) < 2:
      continue
    (kept if i in passed else updated).append(f"{m.group(1)}[{m.group(2)}]")

  def nbytes(found):
    return sum(_WIDTH[s.split("[")[0]] * int(np.prod([int(d) for d in s[s.index("[") + 1:-1]
                                                       .split(",")])) for s in found)

  return Carry(nbytes(updated), tuple(updated), nbytes(kept), tuple(kept))


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\],\s*device_ids=\(\[(?P<dims>[\d,]+)\]"
    r"(?:T\((?P<perm>[\d,]+)\))?\)\s*\{(?P<over>[^}]*)\}"
)


def explicit_groups(hlo_text: str) -> str:
  """``hlo_text`` with its ``replica_groups=mesh[...], device_ids=(...) {...}`` spelt out
  as lists of device ids: ``accum_jax.testing.collectives`` reads the ``mesh[...]`` form
  only without ``device_ids`` (XLA writes it for the scan on the HSDP mesh), and takes a
  collective it cannot read for a group of one; tests/test_cost_model.py holds the case.
  """

  def spelt_out(m: re.Match[str]) -> str:
    sizes = [(a, int(s)) for a, s in re.findall(r"'([^']+)'=(\d+)", m.group("axes"))]
    ids = np.arange(int(np.prod([int(d) for d in m.group("dims").split(",")])))
    ids = ids.reshape([int(d) for d in m.group("dims").split(",")])
    if m.group("perm"):
      ids = ids.transpose([int(p) for p in m.group("perm").split(",")])
    ids = ids.reshape([s for _, s in sizes])
    names = [a for a, _ in sizes]
    over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group("over"))]
    rest = [i for i in range(len(names)) if i not in over]
    groups = ids.transpose(rest + over).reshape(-1, int(np.prod([sizes[i][1] for i in over])))
    return "replica_groups={" + ",".join(
        "{" + ",".join(str(int(i)) for i in g) + "}" for g in groups) + "}"

  return _MESH_GROUPS.sub(spelt_out, hlo_text)


def summarise_collectives(found: list[Any], n: int) -> dict[str, Any]:
  """Per microbatch (in the loop, not in a rare branch), rare, and outside the loop."""
  def group(cs):
    counts = collections.Counter(
        (_KINDS[c.kind], "+".join(c.axes or ()), c.result_bytes <= 64) for c in cs)
    return ", ".join(
        f"{k} {kind}[{axes}]{' (scalars)' if small else ''}"
        for (kind, axes, small), k in sorted(counts.items(), key=lambda x: (x[0][2], x[0][0])))

  loop = [c for c in found if c.in_loop and not c.in_branch]
  rare = [c for c in found if c.in_branch]
  outside = [c for c in found if not c.in_loop and not c.in_branch]
  per_microbatch = sum(c.bytes_sent for c in loop)
  after = sum(c.bytes_sent for c in outside)
  return {
      "per_microbatch_count": len(loop),
      "per_microbatch_bytes": per_microbatch,
      "per_microbatch": group(loop),
      "outside_count": len(outside),
      "outside_bytes": after,
      "outside": group(outside),
      "rare_count": len(rare),
      "per_step_bytes": n * per_microbatch + after,
      "all": [c._asdict() for c in found],
  }


def relative_deviation(out: Any, reference: Any) -> float:
  flat = jax.flatten_util.ravel_pytree
  a, b = flat(jax.device_get(out[1]))[0], flat(reference[1])[0]
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def measure(method: str, problem: Problem, n: int) -> tuple[dict[str, Any], Callable[[], Any]]:
  """Compiles one case: its static figures, and a call for the timing."""
  jitted, args = build(method, problem, n)
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  compile_seconds = time.perf_counter() - start
  text = compiled.as_text()
  memory = memory_analysis_dict(compiled)
  carry = loop_carry(text)
  record = {
      "layout": problem.layout, "method": method, "num_microbatches": n,
      "memory_analysis": memory, "argument_bytes": memory["argument_bytes"],
      "temp_output_bytes": memory["temp_bytes"] + memory["output_bytes"],
      "carry": carry._asdict() if carry else None, "compile_seconds": compile_seconds,
      "collectives": summarise_collectives(collectives(explicit_groups(text), problem.mesh), n),
      "deviation": relative_deviation(compiled(*args), problem.reference)}
  return record, lambda: compiled(*args)


def _mib(x: float) -> str:
  return f"{x / _MIB:.1f}"


def report(records, seconds, samples) -> None:
  for layout in LAYOUTS:
    rows = []
    for (lay, method, n), r in records.items():
      if lay != layout:
        continue
      hand = records[lay, HAND, n]
      c = r["collectives"]
      q1, q3 = quartiles(samples[lay, method, n])
      rows.append([
          n, method, _mib(r["temp_output_bytes"]),
          f"{r['temp_output_bytes'] / hand['temp_output_bytes']:.2f}x",
          _mib(r["argument_bytes"]),
          _mib(r["carry"]["updated_bytes"]) if r["carry"] else "-",
          c["per_microbatch"] or "-", _mib(c["per_microbatch_bytes"]),
          c["outside"] or "-", _mib(c["per_step_bytes"]),
          f"{1e3 * seconds[lay, method, n]:.0f} [{1e3 * q1:.0f}, {1e3 * q3:.0f}]",
          f"{seconds[lay, method, n] / seconds[lay, HAND, n]:.2f}x",
          f"{r['deviation']:.1e}",
      ])
    if not rows:
      continue
    shape, names = LAYOUTS[layout][:2]
    print(f"\n{layout}: mesh {dict(zip(names, shape))}; per device; MiB")
    print(markdown_table(
        ["N", "method", "temp + output", "vs hand-written scan", "arguments",
         "accumulator (loop carry)", "collectives per microbatch", "sent per microbatch",
         "outside the loop", "sent per step", "step ms (median [q1, q3])",
         "time vs hand-written scan", "max grad deviation"], rows))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--num-layers", type=int, default=4)
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4, 8, 16])
  parser.add_argument("--layout-n", type=int, default=8, help="N of the HSDP and tensor rows")
  parser.add_argument("--activation", choices=sorted(ACTIVATIONS), default="tanh",
                      help="the hidden layers' nonlinearity (default tanh)")
  parser.add_argument("--rounds", type=int, default=7, help="timed calls of each (median)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: width 128, 2 layers, batch 64, N in 1 and 4, 2 rounds")
  parser.add_argument("--name", default=None, help="results bench/results/<name>.json"
                      " (default: sharded, or sharded_quick with --quick)")
  args = parser.parse_args(argv)
  global activation
  activation = ACTIVATIONS[args.activation]
  if args.quick:
    args.width, args.num_layers, args.batch_size = 128, 2, 64
    args.ns, args.layout_n, args.rounds = [1, 4], 4, 2
  if bad := [n for n in [*args.ns, args.layout_n] if args.batch_size % (8 * n)]:
    parser.error(f"--batch-size={args.batch_size} must divide into 8 devices x N for N in {bad}.")
  if len(jax.devices()) < 8:
    sys.exit(f"8 devices are needed, there are {len(jax.devices())}: set XLA_FLAGS="
             "--xla_force_host_platform_device_count=8 before jax is imported.")
  name = args.name or ("sharded_quick" if args.quick else "sharded")
  start = time.perf_counter()
  size = (args.width, args.num_layers, args.batch_size)
  problems = {layout: make_problem(layout, *size) for layout in LAYOUTS}
  cases = [("fsdp", m, n) for n in args.ns for m in METHODS]
  cases += [(lay, m, args.layout_n) for lay in ("hsdp", "fsdp x tensor") for m in LAYOUT_METHODS]
  records, calls = {}, {}
  for case in cases:
    records[case], calls[case] = measure(case[1], problems[case[0]], case[2])
  compile_seconds = time.perf_counter() - start
  samples = time_interleaved({case: calls[case] for case in cases}, rounds=args.rounds)
  seconds = {case: statistics.median(s) for case, s in samples.items()}
  param_bytes = args.num_layers * args.width**2 * 4
  for (layout, method, n), r in records.items():
    r["step_seconds"] = seconds[layout, method, n]
    r["step_seconds_quartiles"] = quartiles(samples[layout, method, n])
    r["step_seconds_samples"] = samples[layout, method, n]
    r["time_vs_hand_written"] = seconds[layout, method, n] / seconds[layout, HAND, n]
    r["memory_vs_hand_written"] = (r["temp_output_bytes"]
                                   / records[layout, HAND, n]["temp_output_bytes"])
  config = {
      "width": args.width, "num_layers": args.num_layers, "batch_size": args.batch_size,
      "ns": args.ns, "layout_n": args.layout_n, "rounds": args.rounds, "quick": args.quick,
      "activation": args.activation, "param_bytes": param_bytes, "command": " ".join(sys.argv),
      "environment": environment(), "compile_seconds": compile_seconds,
      "total_seconds": time.perf_counter() - start}
  print(f"{args.num_layers} x {args.width} x {args.width} float32 weights"
        f" ({param_bytes / _MIB:.0f} MiB), batch {args.batch_size}; 8 CPU devices;"
        f" {args.rounds} interleaved rounds; {config['total_seconds']:.0f} s")
  report(records, seconds, samples)
  path = write_json(name, {"config": config, "results": list(records.values())})
  print(f"\nwrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

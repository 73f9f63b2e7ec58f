"""Many devices: data-parallel microbatching with one gradient all-reduce per step.

The batch is sharded over a ``"data"`` mesh axis spanning all devices, the parameters are
replicated, and one jitted step computes the gradient over microbatches and applies Adam::

  grad_fn = accum_jax.value_and_grad(
      loss_fn, num_microbatches,
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="data", param_sharding=P()))

``param_sharding=P()`` says that the parameters are replicated: under ``jax.jit`` with
automatic mesh axes the traced step cannot see it (without it, an
``accum_jax.UnknownShardingWarning`` says so). Each device scans its own shard of the
batch in microbatches and keeps a local sum; the devices' sums are added once, after the
loop. A plain ``jax.lax.scan`` over microbatches
of the sharded batch computes the same numbers, but XLA all-reduces the gradient inside
the loop: once per microbatch. The script counts the collectives in both compiled steps
(inside and outside the loop), checks that both gradients equal the single-device
full-batch gradient, and then trains a small MLP on scikit-learn's 8x8 digits (no
download) for a few steps.

With a single CPU and no accelerator, it asks XLA for 8 CPU devices (unless XLA_FLAGS
already sets a device count), so it shows the real thing on a laptop. On one GPU it runs
on those 8 CPU devices too, as one device has nothing to all-reduce.

  python examples/data_parallel.py                        # 200 steps, a few seconds on 2 CPU cores
  python examples/data_parallel.py --num-microbatches 8
  python examples/data_parallel.py --quick                # 10 steps, a smoke test
"""

from __future__ import annotations

import os

# Before jax is imported: XLA reads the flags once, when it starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import accum_jax  # noqa: E402
from accum_jax.testing import collective_counts  # noqa: E402

PER_DEVICE_BATCH = 64  # examples per device per step
HIDDEN = 256
LEARNING_RATE = 1e-3
# The data-parallel gradient sums in another order than the single-device one; float32
# round-off is ~1e-7 relative, and anything real is far above this.
PARITY_TOLERANCE = 1e-5


def pick_devices() -> list[jax.Device]:
  devices = jax.devices()
  if len(devices) == 1 and devices[0].platform != "cpu":
    try:
      cpus = jax.devices("cpu")
    except RuntimeError:
      cpus = []
    if len(cpus) > 1:
      print(f"one {devices[0].platform} device only: using the {len(cpus)} CPU devices")
      return cpus
  return devices


def init_params(seed: int):
  rng = np.random.default_rng(seed)
  return {
      "hidden": {"w": rng.standard_normal((64, HIDDEN), np.float32) * np.sqrt(2 / 64),
                 "b": np.zeros(HIDDEN, np.float32)},
      "out": {"w": rng.standard_normal((HIDDEN, 10), np.float32) * np.sqrt(1 / HIDDEN),
              "b": np.zeros(10, np.float32)},
  }


def apply_model(params, x):
  h = jax.nn.gelu(x @ params["hidden"]["w"] + params["hidden"]["b"])
  return h @ params["out"]["w"] + params["out"]["b"]


def loss_fn(params, batch):
  logits = apply_model(params, batch["x"])
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@jax.jit
def accuracy(params, x, y):
  return jnp.mean(jnp.argmax(apply_model(params, x), axis=-1) == y)


def plain_scan_value_and_grad(loss_fn, num_microbatches, mesh):
  """The obvious way: a ``lax.scan`` over microbatches, each sharded over all devices.

  Device d holds rows [d * m * N, (d + 1) * m * N) of the batch; microbatch i takes rows
  [i * m, (i + 1) * m) of every device's block, as accum_jax's split does, so both compute
  the same microbatches, and no data moves between devices to form them.
  """

  def value_and_grad(params, batch):
    num_devices = mesh.shape["data"]

    def split(x):
      x = x.reshape(num_devices, num_microbatches, -1, *x.shape[1:]).swapaxes(0, 1)
      x = x.reshape(num_microbatches, -1, *x.shape[3:])
      return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "data")))

    def body(total, microbatch):
      out = jax.value_and_grad(loss_fn)(params, microbatch)
      return jax.tree.map(jnp.add, total, out), None

    zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
    total, _ = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
    return jax.tree.map(lambda x: x / num_microbatches, total)

  return value_and_grad


def make_train_step(grad_fn, optimizer):
  # Returns the gradient too, for the parity check below; a real step need not.
  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  return train_step


def relative_deviation(grads, reference):
  """Global norm of the difference over the reference's, on the host in float64."""
  diff = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
          for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))]
  norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(reference)))
  return float(np.sqrt(sum(np.sum(d**2) for d in diff)) / norm)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
  parser.add_argument(
      "--num-microbatches", type=int, default=4,
      help=f"microbatches per device per step; divides {PER_DEVICE_BATCH} (default 4)",
  )
  parser.add_argument("--quick", action="store_true", help="10 training steps, a smoke test")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and sampling")
  args = parser.parse_args()
  steps = 10 if args.quick else args.steps
  num_microbatches = args.num_microbatches
  if steps < 1:
    parser.error(f"--steps={steps} must be >= 1")
  if num_microbatches < 1 or PER_DEVICE_BATCH % num_microbatches:
    parser.error(f"--num-microbatches={num_microbatches} must divide {PER_DEVICE_BATCH}")
  jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on GPUs

  start = time.perf_counter()
  devices = pick_devices()
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=devices)
  batch_size = PER_DEVICE_BATCH * len(devices)
  print(f"mesh: {len(devices)} {devices[0].platform} device(s) along 'data'; batch {batch_size}"
        f" = {len(devices)} devices x {num_microbatches} microbatches x"
        f" {PER_DEVICE_BATCH // num_microbatches} examples")

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  rng = np.random.default_rng(args.seed)
  replicated, by_data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  def sample_batch():
    idx = rng.choice(len(y), batch_size, replace=False)
    return jax.device_put({"x": x[idx], "y": y[idx]}, by_data)

  params = jax.device_put(init_params(args.seed), replicated)
  optimizer = optax.adam(LEARNING_RATE)
  opt_state = jax.device_put(optimizer.init(params), replicated)
  steps_by_name = {
      "accum_jax": make_train_step(
          accum_jax.value_and_grad(loss_fn, num_microbatches,
              data_parallel=accum_jax.DataParallel(
                  mesh=mesh, data_axis="data", param_sharding=P())),
          optimizer),
      "plain scan": make_train_step(
          plain_scan_value_and_grad(loss_fn, num_microbatches, mesh), optimizer),
  }

  # Where the cross-device collectives sit in each compiled step (Adam included).
  batch = sample_batch()
  print(f"\ncollectives in the compiled step    {'in loop':>8s} {'after loop':>11s}")
  compiled, in_loop = {}, {}
  for name, step in steps_by_name.items():
    compiled[name] = step.lower(params, opt_state, batch).compile()
    counts = collective_counts(compiled[name].as_text())
    in_loop[name] = counts.in_loop
    print(f"collectives, {name + ':':22s} {counts.in_loop:8d} {counts.outside_loop:11d}")
  print(f"(an in-loop collective runs once per microbatch: {num_microbatches} times a step)")

  # Parity with the plain full-batch gradient on one device.
  one_device = devices[0]
  reference_loss, reference = jax.jit(jax.value_and_grad(loss_fn))(
      jax.device_put(params, one_device), jax.device_put(batch, one_device))
  print("\ndeviation from the single-device full batch   loss |diff|   grad rel")
  worst = 0.0
  for name, step in compiled.items():
    _, _, loss, grads = step(params, opt_state, batch)
    loss_diff = abs(float(loss) - float(reference_loss))
    grad_rel = relative_deviation(grads, reference)
    worst = max(worst, loss_diff / abs(float(reference_loss)), grad_rel)
    print(f"parity, {name + ':':38s} {loss_diff:11.2e} {grad_rel:10.2e}")

  print(f"\ntraining {steps} steps with accum_jax")
  train_step = compiled["accum_jax"]  # every batch has the same shape and sharding
  losses = []
  for i in range(1, steps + 1):
    params, opt_state, loss, _ = train_step(params, opt_state, sample_batch())
    losses.append(float(loss))
    if i == 1 or i % (steps // 5 or 1) == 0 or i == steps:
      print(f"step {i:4d}  loss {losses[-1]:.4f}")
  print(f"first loss: {losses[0]:.4f}")
  print(f"last loss:  {losses[-1]:.4f}")
  print(f"training-set accuracy: {float(accuracy(params, x, y)):.3f}")
  ok = worst < PARITY_TOLERANCE and in_loop["accum_jax"] == 0
  if ok:
    print("verdict: same gradient as one device on the full batch, reduced once per step,"
          f" not {num_microbatches} times")
  else:
    print(f"verdict: FAILED (largest relative deviation {worst:.1e}, accum_jax collectives"
          f" in the loop: {in_loop['accum_jax']})")
  print(f"time, imports not counted: {time.perf_counter() - start:.1f} s")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())

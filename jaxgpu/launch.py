"""Start one process per GPU, the way multi-host JAX runs start, and join them in the script.

On each host (the same command on one host or many; only --node-rank differs):

    python -m jaxgpu.launch --nproc 2 -- python3 train.py --steps 100
    python -m jaxgpu.launch --nproc 8 --nnodes 4 --node-rank $RANK \\
        --coordinator host0:12355 -- python3 train.py

and in the script, before any other JAX call:

    import jaxgpu.launch
    jaxgpu.launch.initialize()      # jax.distributed.initialize from the launcher's env
    # jax.devices() now lists every process's devices; jax.local_devices() this one's

Each process gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES (nnodes * nproc),
JAX_PROCESS_ID (node_rank * nproc + local rank) and JAX_LOCAL_DEVICE_IDS (the one local GPU
it drives). Process 0 of node 0 hosts the coordinator, so --coordinator must name that host
and a free port (default, on one host: a free port of this host). Under a
cluster manager that already starts one process per GPU (Slurm, Open MPI),
jax.distributed.initialize() finds these values itself and this launcher is not needed.

NCCL's NVLink multicast (NVLS) stays off (NCCL_NVLS_ENABLE=0 in every child's
environment): on shared hosts a fault in it can take the GPUs out of service.
`--platform cpu` runs the same launch on CPU devices (gloo collectives), for tests.

The launcher prefixes each child's output lines with its process id, waits for all of
them, and stops the others as soon as one fails (a collective would otherwise wait forever
for the missing process). Its exit status is the first failure's, or 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAX_LOCAL_DEVICE_IDS"
# Environment the launcher always sets: NVLink multicast off (see the module docstring).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def initialize() -> None:
  """jax.distributed.initialize with the launcher's environment (module docstring); a no-op
  outside the launcher. On CPU (JAX_PLATFORMS=cpu) it selects gloo collectives first."""
  if ENV_NUM_PROCESSES not in os.environ:
    return
  import jax

  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  local = os.environ.get(ENV_LOCAL_DEVICES)
  jax.distributed.initialize(
      coordinator_address=os.environ[ENV_COORDINATOR],
      num_processes=int(os.environ[ENV_NUM_PROCESSES]),
      process_id=int(os.environ[ENV_PROCESS_ID]),
      local_device_ids=[int(x) for x in local.split(",")] if local else None)


def child_env(base: dict, *, coordinator: str, num_processes: int, process_id: int,
              local_rank: int, platform: str, cpu_devices: int) -> dict:
  env = dict(base)
  env.update(SAFE_ENV)
  env[ENV_COORDINATOR] = coordinator
  env[ENV_NUM_PROCESSES] = str(num_processes)
  env[ENV_PROCESS_ID] = str(process_id)
  env["PYTHONUNBUFFERED"] = "1"
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env.pop(ENV_LOCAL_DEVICES, None)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = (flags + f" --xla_force_host_platform_device_count={cpu_devices}").strip()
  else:
    env[ENV_LOCAL_DEVICES] = str(local_rank)
  return env


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("", 0))
    return s.getsockname()[1]


def _pump(stream, prefix: str) -> None:
  for line in iter(stream.readline, b""):
    sys.stdout.buffer.write(prefix.encode() + line)
    sys.stdout.buffer.flush()


def launch(command: list[str], *, nproc: int, nnodes: int = 1, node_rank: int = 0,
           coordinator: str | None = None, platform: str = "gpu", cpu_devices: int = 1) -> int:
  """Runs `command` nproc times on this host (module docstring); returns the exit status."""
  if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
    raise ValueError(f"nproc: expected >= 1 (got {nproc}), nnodes >= 1 (got {nnodes}), "
                     f"0 <= node_rank < nnodes (got {node_rank})")
  if nnodes > 1 and not coordinator:
    raise ValueError("coordinator: required with nnodes > 1 (host:port of node 0)")
  coordinator = coordinator or f"127.0.0.1:{_free_port()}"
  procs, pumps = [], []
  for local in range(nproc):
    pid = node_rank * nproc + local
    env = child_env(os.environ, coordinator=coordinator, num_processes=nnodes * nproc,
                    process_id=pid, local_rank=local, platform=platform,
                    cpu_devices=cpu_devices)
    p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    t = threading.Thread(target=_pump, args=(p.stdout, f"[{pid}] "), daemon=True)
    t.start()
    procs.append(p)
    pumps.append(t)
  status = 0
  remaining = set(range(nproc))
  while remaining:
    for i in sorted(remaining):
      try:
        rc = procs[i].wait(timeout=0.5)
      except subprocess.TimeoutExpired:
        continue
      remaining.discard(i)
      if rc != 0 and status == 0:
        status = rc
        print(f"[launch] process {node_rank * nproc + i} exited with {rc}; stopping the "
              "others", flush=True)
        for j in remaining:
          try:
            os.killpg(procs[j].pid, signal.SIGTERM)
          except ProcessLookupError:
            pass
  for t in pumps:
    t.join(timeout=5)
  return status


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m jaxgpu.launch",
                              description="one process per GPU (module docstring)")
  p.add_argument("--nproc", type=int, required=True, help="processes (GPUs) on this host")
  p.add_argument("--nnodes", type=int, default=1, help="hosts in the run")
  p.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
  p.add_argument("--coordinator", default=None, help="host:port of node 0's process 0")
  p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu")
  p.add_argument("--cpu-devices", type=int, default=1,
                 help="with --platform cpu: fake CPU devices per process")
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  args = p.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    p.error("command: give the command to run after --")
  return launch(command, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                coordinator=args.coordinator, platform=args.platform,
                cpu_devices=args.cpu_devices)


if __name__ == "__main__":
  sys.exit(main())

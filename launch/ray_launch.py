#!/usr/bin/env python
"""Launch a multi-node ``megatron-dapo train`` job on an existing Ray cluster (``ray start`` nodes or KubeRay).

    python launch/ray_launch.py CONFIG [dotted.overrides ...] --nnodes N --nproc-per-node P [--address ADDR]

What it does:

1. connects to the cluster (``--address``, default ``auto``: the local node's running cluster or ``RAY_ADDRESS``);
2. reserves one bundle per node in a placement group (``STRICT_SPREAD``: every bundle on a different node;
   ``--allow-same-node`` uses ``PACK`` instead, for a single-machine cluster); each bundle asks for
   ``--cpus-per-node`` CPUs and ``--gpus-per-node`` GPUs (default: ``--nproc-per-node`` GPUs when the cluster has
   GPUs) so that Ray does not place two jobs on the same accelerators;
3. starts one actor per bundle; node 0's actor reports its IP (``MASTER_ADDR``) and a free port (``MASTER_PORT``,
   unless ``--master-port``);
4. each actor runs ``launch/run_node.sh CONFIG overrides`` (the command every node runs without Ray) with
   ``NNODES``, ``NODE_RANK``, ``NPROC_PER_NODE``, ``MASTER_ADDR``, ``MASTER_PORT`` set; the checkout must be at
   the same path on every node (``--repo-dir``, default: this one), as for ``run_node.sh``;
5. streams node 0's output (rank 0 logs); a node whose torchrun exits non-zero (or whose actor dies) stops the job:
   the launcher names the node and its IP, prints the tail of its output, kills the other nodes' torchruns and
   exits with status 1. All nodes exiting 0 exits 0. Ctrl-C / SIGTERM kill every node's torchrun too.

The torchrun processes belong to the actors; each is started with a parent-death signal, so if its actor dies the
torchrun receives SIGTERM and stops its ranks. Ray itself is an optional dependency: ``pip install -e .[ray]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 60
POLL_S = 0.5


class LaunchError(RuntimeError):
    """The job could not be placed or started; the message says what to change."""


def _set_parent_death_signal() -> None:  # runs in the child between fork and exec (Linux only)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class NodeRunner:
    """Lives on one node (as a Ray actor): runs that node's ``run_node.sh`` and keeps its output."""

    def __init__(self) -> None:
        self.proc = None
        self.lines: deque[str] = deque()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.reader = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a currently free TCP port on it."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port

    def start(self, cmd: list[str], env: dict[str, str], cwd: str) -> int:
        import subprocess
        import threading

        full_env = dict(os.environ)
        full_env.setdefault("PYTHON", sys.executable)  # the Ray worker's interpreter: the job's environment
        full_env.update(env)
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            preexec_fn=_set_parent_death_signal if sys.platform.startswith("linux") else None,
        )

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                self.tail.append(line)

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        return self.proc.pid

    def read(self) -> list[str]:
        """Output lines since the last call."""
        out = []
        while self.lines:
            out.append(self.lines.popleft())
        return out

    def poll(self) -> Optional[int]:
        """The exit status once torchrun has exited and its output is read, else None."""
        code = self.proc.poll()
        if code is None:
            return None
        self.reader.join(timeout=5)
        return code

    def last_lines(self) -> list[str]:
        return list(self.tail)

    def kill(self) -> None:
        """Stop torchrun and every process under it (its ranks run in sessions of their own)."""
        import subprocess

        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        self.proc.terminate()  # torchrun forwards SIGTERM to its ranks and waits for them
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for p in procs:  # whatever outlived torchrun
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="experiment YAML (configs/*.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, passed to every node")
    p.add_argument("--nnodes", type=int, required=True, help="nodes (one placement-group bundle each)")
    p.add_argument("--nproc-per-node", type=int, required=True, help="torchrun processes per node")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0 (default: a free one)")
    p.add_argument("--cpus-per-node", type=float, default=1.0, help="CPUs each bundle reserves (default 1)")
    p.add_argument(
        "--gpus-per-node", type=float, default=None, help="GPUs each bundle reserves (default: nproc if GPUs exist)"
    )
    p.add_argument(
        "--allow-same-node",
        action="store_true",
        help="PACK instead of STRICT_SPREAD: bundles may share a node (single-machine clusters, tests)",
    )
    p.add_argument("--placement-timeout", type=float, default=120.0, help="seconds to wait for the placement group")
    p.add_argument("--repo-dir", default=str(REPO_ROOT), help="the checkout on every node (default: this one)")
    return p


def run(args: argparse.Namespace) -> int:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if args.nnodes < 1 or args.nproc_per_node < 1:
        raise LaunchError(f"--nnodes={args.nnodes} and --nproc-per-node={args.nproc_per_node} must both be >= 1")
    config = Path(args.config)
    if not config.is_file():
        raise LaunchError(f"config file {config} not found")
    script = Path(args.repo_dir) / "launch" / "run_node.sh"
    ray.init(address=args.address, log_to_driver=False)
    gpus = args.gpus_per_node
    if gpus is None:
        gpus = float(args.nproc_per_node) if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    bundle = {"CPU": args.cpus_per_node, **({"GPU": gpus} if gpus else {})}
    strategy = "PACK" if args.allow_same_node else "STRICT_SPREAD"
    pg = placement_group([dict(bundle) for _ in range(args.nnodes)], strategy=strategy)
    runners: list = []
    try:
        _wait_for_placement(pg, args, bundle, strategy)
        _create_runners(pg, args.nnodes, runners)
        ips = _start_nodes(runners, args, config, script)
        return supervise(runners, ips)
    finally:
        for runner in runners:
            try:
                ray.get(runner.kill.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - the actor may be gone already; its torchrun got the death signal
                pass
            ray.kill(runner)
        remove_placement_group(pg)
        ray.shutdown()


def _wait_for_placement(pg, args: argparse.Namespace, bundle: dict, strategy: str) -> None:
    """Wait up to ``--placement-timeout`` for the placement group; a :class:`LaunchError` saying why otherwise."""
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=args.placement_timeout)
    if ready:
        return
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    raise LaunchError(
        f"could not reserve {args.nnodes} bundles of {bundle} with strategy {strategy} within"
        f" {args.placement_timeout:.0f}s: the cluster has {len(nodes)} alive node(s) with"
        f" {ray.available_resources()} available"
        + ("" if args.allow_same_node else " (STRICT_SPREAD needs one node per bundle; see --allow-same-node)")
    )


def _create_runners(pg, nnodes: int, runners: list) -> None:
    """One :class:`NodeRunner` actor per bundle, appended to ``runners`` (so the caller can stop them all)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_cls = ray.remote(num_cpus=0)(NodeRunner)
    for i in range(nnodes):
        strategy_i = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        runners.append(actor_cls.options(scheduling_strategy=strategy_i, num_gpus=0).remote())


def _start_nodes(runners: list, args: argparse.Namespace, config: Path, script: Path) -> list[str]:
    """Start ``run_node.sh`` on every node with node 0 as the rendezvous; returns the nodes' IPs."""
    import ray

    addresses = ray.get([r.address.remote() for r in runners])
    ips = [ip for ip, _ in addresses]
    master_addr = ips[0]
    master_port = args.master_port or addresses[0][1]
    print(
        f"ray_launch: {args.nnodes} node(s) {ips}, {args.nproc_per_node} process(es) each,"
        f" MASTER_ADDR={master_addr} MASTER_PORT={master_port}",
        flush=True,
    )
    for rank, runner in enumerate(runners):
        env = {
            "NNODES": str(args.nnodes),
            "NODE_RANK": str(rank),
            "NPROC_PER_NODE": str(args.nproc_per_node),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        cmd = ["bash", str(script), str(config.resolve()), *args.overrides]
        ray.get(runner.start.remote(cmd, env, str(args.repo_dir)))
    return ips


def supervise(runners: list, ips: list[str]) -> int:
    """Stream node 0's output until every node exits; the first failure stops the job (see the module docstring)."""
    import ray

    done: dict[int, int] = {}
    while len(done) < len(runners):
        for line in ray.get(runners[0].read.remote()):
            sys.stdout.write(line)
        sys.stdout.flush()
        for rank, runner in enumerate(runners):
            if rank in done:
                continue
            try:
                code = ray.get(runner.poll.remote())
            except ray.exceptions.RayActorError as exc:
                print(f"ray_launch: node {rank} ({ips[rank]}): its actor died ({exc}); stopping the job", flush=True)
                return 1
            if code is None:
                continue
            done[rank] = code
            if code != 0:
                if rank == 0:
                    for line in ray.get(runner.read.remote()):
                        sys.stdout.write(line)
                tail = "".join(ray.get(runner.last_lines.remote()))
                print(
                    f"ray_launch: node {rank} ({ips[rank]}) failed: run_node.sh exited with status {code};"
                    f" stopping the other nodes. Last lines of node {rank}:\n{tail}",
                    flush=True,
                )
                return 1
        time.sleep(POLL_S)
    for line in ray.get(runners[0].read.remote()):
        sys.stdout.write(line)
    print(f"ray_launch: all {len(runners)} node(s) finished", flush=True)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_intermixed_args(argv)

    def on_term(signum, frame):  # turn SIGTERM into the same clean-up path as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run(args)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ray_launch: interrupted; the nodes' torchruns were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The first process of a simulated node (pid 1 of its pid namespace): names the node, gives it a /dev/shm of its
own, starts the node's command and then reaps whatever ends in the node, for as long as the node lives. It does
not exit when the command does, so an orphan of the command (a worker whose agent died) lives on, as on a real
host, until it ends by itself or the node is killed whole (SIGKILL of this process ends every process in it)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hostname", required=True)
    p.add_argument("--shm", default="256m", help="the size of the node's own /dev/shm (a tmpfs)")
    p.add_argument("--cwd", default=os.getcwd())
    p.add_argument(
        "--hosts", help="the cluster's /etc/hosts (every node by name, as a cluster's DNS serves them)"
    )
    p.add_argument("--status", help="a file the command's exit status is written to when it ends")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    socket.sethostname(args.hostname)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.shm}", "tmpfs", "/dev/shm"], check=True)
    if args.hosts:
        subprocess.run(["mount", "--bind", args.hosts, "/etc/hosts"], check=True)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the pause below when an adopted orphan ends
    child = subprocess.Popen(command, cwd=args.cwd, stdin=subprocess.DEVNULL).pid if command else 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            signal.pause()
            continue
        if pid == child and args.status:
            # Written aside and renamed: a reader that sees the file sees the whole status.
            Path(args.status + ".tmp").write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(args.status + ".tmp", args.status)


if __name__ == "__main__":
    main()

"""The sandbox's first program: runs inside bubblewrap, before and around one candidate.

Standard library only (rayeval is not inside the sandbox). It reads one JSON request on stdin,
then, in this order: lowers its resource limits (they bind every process it starts), drops to
the unprivileged uid (when the sandbox started as root), imports the modules lm-eval's own
process has imported when code_eval forks a candidate (so that ``import numpy`` behaves the same
under code_eval's guard), and calls the pinned ``execute.check_correctness`` exactly as
code_eval does. It prints ``READY`` before the candidate starts (a line without it means the
sandbox, not the candidate, failed) and the result as the last line.
"""

import json
import os
import resource
import sys

READY = "rayeval-sandbox-ready"
RESULT = "rayeval-sandbox-result "

_LIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_bytes": resource.RLIMIT_FSIZE,
    "open_files": resource.RLIMIT_NOFILE,
}


def _drop_privileges(uid, gid):
    """Become ``uid``/``gid`` for real (the kernel then also counts RLIMIT_NPROC, which it
    ignores for root) with no supplementary groups; capabilities go with uid 0."""
    if os.getuid() != 0:
        return
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SystemExit("the sandbox could not leave uid 0")


def main():
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    for name, limit in _LIMITS.items():
        value = int(request["limits"][name])
        resource.setrlimit(limit, (value, value))
    _drop_privileges(int(request["uid"]), int(request["gid"]))
    os.chdir("/tmp")
    sys.path[1:1] = request["sys_path"]
    for module in request["preload"]:
        __import__(module)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_eval"))
    from execute import check_correctness

    print(READY, flush=True)
    result = check_correctness(
        request["program"], request["timeout"], request["task_id"], request["completion_id"]
    )
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Exec helper of the process kubelet: enters the pod's network namespace, sets up one container's mount and UTS
namespaces, drops privileges, execs.

    python -I -S podexec.py SPEC_JSON

Standard library only and no site import, so it starts in ~25 ms. SPEC_JSON keys:
  argv, workdir, uid, gid, groups   the command and the identity to run it as (uid None: stay root)
  errfd                             a pipe: a failure is written there, a successful exec closes it
  and either, for a new container:  netns: the pod's network namespace (a path under /run/netns), shared by its
                                    containers; hostname, mounts [{source, target, readonly}], readonly_root, and
                                    either, run from the host:
                                    traversable [dir], host [dir]: what the commands run from (the venv, the
                                    project), kept visible where a volume is mounted over them (an emptyDir at /tmp
                                    over a checkout there)
                                    or, run from an image: rootfs {image, upper, work, root}: an overlay of a
                                    writable layer of its own (upper, work) over the image's root filesystem, at
                                    root, with the host's /proc, /sys and /dev; the mounts go below it, and the
                                    command runs chrooted there
  or, to run in a running one:      join_pid: its network, mount and UTS namespaces and its root are joined
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import sys
import warnings

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

libc = ctypes.CDLL(None, use_errno=True)
PRELOADED = (warnings,)  # os.execvp imports it on first use: after a chroot into an image, too late


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _b(s: str | None) -> bytes | None:
    return None if s is None else s.encode()


def mount(source: str | None, target: str, flags: int, fstype: str | None = None, data: str | None = None,
          name: str | None = None) -> None:
    _check(libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           f"mount {name or source or fstype or ''} on {target}")


def umount(target: str) -> None:
    _check(libc.umount2(_b(target), MNT_DETACH), f"umount {target}")


def setns(path: str, flag: int) -> None:
    """Move the calling thread into the namespace that `path` names (/run/netns/NAME, /proc/PID/ns/net)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, flag), f"setns {path}")
    finally:
        os.close(fd)


def in_root(root: str, path: str) -> str:
    """`path` as a process chrooted at `root` sees it, on this side: its symlinks resolved inside root (an image's
    /var/run -> /run must not lead to the host's /run), as runtimes resolve mount targets (runc's securejoin)."""
    parts, resolved, hops = [p for p in path.split("/") if p], [], 0
    while parts:
        part = parts.pop(0)
        if part in (".", ".."):
            if part == ".." and resolved:
                resolved.pop()
            continue
        here = os.path.join(root, *resolved, part)
        if os.path.islink(here):
            hops += 1
            if hops > 40:
                raise OSError(40, f"too many levels of symbolic links: {path} in {root}")
            link = os.readlink(here)
            resolved = [] if link.startswith("/") else resolved
            parts = [p for p in link.split("/") if p] + parts
        else:
            resolved.append(part)
    return os.path.join(root, *resolved)


def make_traversable(path: str) -> None:
    """Cover a directory that others may not enter (/root, holding a pyenv Python) with a tmpfs that they may,
    holding bind mounts of everything that was in it: the same tree, so a non-root container reaches the Python."""
    fd = os.open(path, os.O_PATH | os.O_DIRECTORY)  # the covered directory stays reachable through it
    st = os.fstat(fd)
    names = os.listdir(f"/proc/self/fd/{fd}")
    mount("tmpfs", path, 0, "tmpfs", f"mode={(st.st_mode & 0o7777) | 0o711:o},uid={st.st_uid},gid={st.st_gid}")
    for name in names:
        source, target = f"/proc/self/fd/{fd}/{name}", os.path.join(path, name)
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            os.mkdir(target)
            mount(source, target, MS_BIND | MS_REC)
        elif os.path.isfile(source):
            open(target, "w").close()
            mount(source, target, MS_BIND)
    os.close(fd)


def new_container(spec: dict) -> None:
    if spec.get("netns"):
        setns(spec["netns"], CLONE_NEWNET)
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    mount(None, "/", MS_REC | MS_PRIVATE)  # nothing mounted below propagates back to the host
    try:
        # The copies of the named network namespaces' mounts would keep every other pod's namespace alive for as long
        # as this container runs: detach them here (the container is in its own namespace already).
        umount("/run/netns")
    except OSError:
        pass  # not a mount point: no named namespaces
    name = spec["hostname"].encode()
    _check(libc.sethostname(name, len(name)), "sethostname")
    # Every source is opened before anything is mounted: a volume at /tmp would hide the kubelet's dir there.
    sources = [os.open(m["source"], os.O_PATH) for m in spec["mounts"]]
    host = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY)) for path in spec.get("host", [])]
    for path in spec.get("traversable", []):
        make_traversable(path)
    root = "/"
    if rootfs := spec.get("rootfs"):
        root = rootfs["root"]
        mount("overlay", root, 0, "overlay",
              f"lowerdir={rootfs['image']},upperdir={rootfs['upper']},workdir={rootfs['work']}")
        for system in ("proc", "sys", "dev"):  # the host's, as a runtime's defaults show them (without its masks)
            os.makedirs(os.path.join(root, system), exist_ok=True)
            mount(f"/{system}", os.path.join(root, system), MS_BIND | MS_REC)
    for m, fd in zip(spec["mounts"], sources):
        target = in_root(root, m["target"])
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.makedirs(target, exist_ok=True)
        elif not os.path.exists(target):  # a file (a configMap key, the hosts file) needs a file to cover
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        mount(f"/proc/self/fd/{fd}", target, MS_BIND | MS_REC, name=m["source"])
        os.close(fd)
        if m["readonly"]:
            mount(None, target, MS_REMOUNT | MS_BIND | MS_RDONLY)
    for path, fd in host:  # outermost first: binding a directory brings the ones below it back too
        try:
            hidden = not os.path.samestat(os.stat(path), os.fstat(fd))
        except FileNotFoundError:
            hidden = True
        if hidden:
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, MS_BIND | MS_REC, name=path)
        os.close(fd)
    if spec["workdir"]:  # as container runtimes do; before / may turn read-only
        os.makedirs(in_root(root, spec["workdir"]), exist_ok=True)
    if spec["readonly_root"]:
        # The root mount's own flag only: the volumes mounted above are separate mounts and stay writable.
        mount(None, root, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.chroot(root)


def join_container(pid: int) -> None:
    # Every namespace and the root opened first: once in the container's mount namespace, its /proc may differ.
    fds = [(os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY), ns, flag)
           for ns, flag in (("net", CLONE_NEWNET), ("mnt", CLONE_NEWNS), ("uts", CLONE_NEWUTS))]
    root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY)
    for fd, ns, flag in fds:
        _check(libc.setns(fd, flag), f"setns {ns} of pid {pid}")
        os.close(fd)
    os.fchdir(root)  # as nsenter --root: the container's root (an image's) becomes this one's
    os.chroot(".")
    os.close(root)


def _fail(errfd: int, message: str) -> None:
    os.write(errfd, message.encode())
    os._exit(128)


def main() -> None:
    spec = json.loads(sys.argv[1])
    errfd, argv = spec["errfd"], spec["argv"]
    try:
        if spec.get("join_pid"):
            join_container(spec["join_pid"])
        else:
            new_container(spec)
        os.chdir(spec["workdir"] or "/")
        if spec["uid"] is not None:
            os.setgroups(spec["groups"])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
    except OSError as e:
        _fail(errfd, str(e))
    os.set_inheritable(errfd, False)  # close-on-exec: a successful exec closes it, which the kubelet waits for
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        _fail(errfd, f'exec: "{argv[0]}": executable file not found in $PATH')
    except OSError as e:
        _fail(errfd, f'exec: "{argv[0]}": {e.strerror}')


if __name__ == "__main__":
    main()

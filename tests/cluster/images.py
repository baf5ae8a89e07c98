"""The project's images as the tests use them: built by scripts/images.sh with buildah (cached), and served to the
process kubelet as root filesystems.

- built(): {target: image} of the Dockerfile's targets, building what is missing.
- ImageStore: an image of this machine's buildah store (`localhost/...`) as a read-only root filesystem and the
  config a container runtime takes from it (Env, User, WorkingDir, Entrypoint, Cmd). Each image is mounted once per
  kubelet, in a buildah working container that the kubelet removes when it stops (a crashed one's are swept by the
  next); every container gets an overlay of its own above it (tests/cluster/podexec.py), so that nothing a pod
  writes reaches the image or another pod.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[2]
LOCAL = "localhost/"  # the images this store serves; any other runs from the host, as before (kubelet.py)


@functools.cache
def built() -> dict[str, str]:
    """{target: image} of every Dockerfile target, built (or found) by scripts/images.sh."""
    out = subprocess.run([str(ROOT / "scripts/images.sh")], capture_output=True, text=True,
                         env={**os.environ, "PY": sys.executable})  # a python with pip: its configuration
    if out.returncode:
        raise RuntimeError(f"scripts/images.sh failed:\n{out.stderr[-4000:]}")
    return dict(line.split("=", 1) for line in out.stdout.split())


class ImageError(Exception):
    """The image is not in the store (ErrImageNeverPull: nothing here pulls)."""


@dataclass(frozen=True)
class Image:
    ref: str
    rootfs: Path
    env: dict[str, str]
    user: str  # the image's USER ("" for root), as "uid[:gid]" or a name of its /etc/passwd
    workdir: str
    entrypoint: list[str]
    cmd: list[str]

    def identity(self) -> tuple[int, int | None]:
        """(uid, gid) of its USER: numbers, or names in the image's /etc/passwd and /etc/group (gid None: the user's
        primary group)."""
        name, _, group = self.user.partition(":")
        uid = int(name) if name.isdigit() else self._lookup("passwd", name)[2]
        gid = int(group) if group.isdigit() else self._lookup("group", group)[2] if group else None
        return int(uid), None if gid is None else int(gid)

    def home(self, uid: int) -> tuple[str, int | None]:
        """The HOME and primary group a runtime gives uid: from the image's /etc/passwd, else / and no group."""
        for fields in self._tables["passwd"]:
            if fields[2] == str(uid):
                return fields[5], int(fields[3])
        return "/", None

    @functools.cached_property
    def _tables(self) -> dict[str, list[list[str]]]:
        """Its /etc/passwd and /etc/group, read once (every container start and exec probe asks; they never change)."""
        paths = {kind: self.rootfs / "etc" / kind for kind in ("passwd", "group")}
        return {kind: [line.split(":") for line in path.read_text().splitlines() if line] if path.exists() else []
                for kind, path in paths.items()}

    def _lookup(self, kind: str, name: str) -> list[str]:
        for fields in self._tables[kind]:
            if fields[0] == name:
                return fields
        raise ImageError(f"unable to find {'user' if kind == 'passwd' else 'group'} {name}: no matching entries in "
                         f"{kind} file of image {self.ref}")


class ImageStore:
    """The local images, mounted on first use; thread-safe. close() removes its working containers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._images: dict[str, Image] = {}
        self._prefix = f"pat-kubelet-{os.getpid()}-{secrets.token_hex(3)}-"

    @staticmethod
    def serves(ref: str) -> bool:
        return ref.startswith(LOCAL)

    def get(self, ref: str) -> Image:
        with self._lock:
            if ref not in self._images:
                if not self._images:  # the first image pod: what crashed kubelets left goes first
                    self._sweep()
                self._images[ref] = self._mount(ref)
            return self._images[ref]

    def close(self) -> None:
        with self._lock:
            names, self._images = [self._container(i.ref) for i in self._images.values()], {}
        if names:
            subprocess.run(["buildah", "rm", *names], capture_output=True)

    def _container(self, ref: str) -> str:
        return self._prefix + re.sub(r"[^a-zA-Z0-9_.-]", "_", ref.removeprefix(LOCAL))

    @staticmethod
    def _sweep() -> None:
        """The working containers of kubelets whose process is gone (killed before close())."""
        listed = subprocess.run(["buildah", "containers", "--format", "{{.ContainerName}}"], capture_output=True,
                                text=True).stdout.split()
        dead = [n for n in listed if (m := re.match(r"pat-kubelet-(\d+)-", n)) and not os.path.exists(f"/proc/{m[1]}")]
        if dead:
            subprocess.run(["buildah", "rm", *dead], capture_output=True)

    def _mount(self, ref: str) -> Image:
        inspect = subprocess.run(["buildah", "inspect", "--type", "image", ref], capture_output=True, text=True)
        if inspect.returncode:
            raise ImageError(f'Container image "{ref}" is not present with pull policy of Never '
                             f"(scripts/images.sh builds the project's images)")
        config = json.loads(inspect.stdout)["OCIv1"].get("config", {})
        name = self._container(ref)
        subprocess.run(["buildah", "from", "--pull-never", "--name", name, ref], capture_output=True, text=True,
                       check=True)
        rootfs = subprocess.run(["buildah", "mount", name], capture_output=True, text=True, check=True).stdout.strip()
        env = dict(e.split("=", 1) for e in config.get("Env") or [])
        return Image(ref, Path(rootfs), env, config.get("User", ""), config.get("WorkingDir", ""),
                     config.get("Entrypoint") or [], config.get("Cmd") or [])

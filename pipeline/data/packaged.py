"""Real data sets that ship in system packages, for the demos: nothing is fetched from a data hub.

- **Fashion-MNIST** (Zalando Research, MIT): Debian's ``dataset-fashion-mnist`` installs the four original IDX
  files under ``/usr/share/datasets/fashion-mnist/``: 60,000 training and 10,000 test images, 28x28 grey,
  10 balanced classes (``FASHION_MNIST_CLASSES``, in label order).

``debian_folder`` installs a package when its folder is missing (``apt-get`` as root, or through ``sudo``), as
``tests/system-packages.sh`` installs the browser; where it cannot, the error names the package and the command.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DebianData:
    package: str
    folder: Path
    files: tuple[str, ...]  # what the package puts in ``folder``, all of which must be there

    def present(self) -> bool:
        return all((self.folder / name).is_file() for name in self.files)


FASHION_MNIST = DebianData(
    "dataset-fashion-mnist", Path("/usr/share/datasets/fashion-mnist"),
    ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
     "t10k-labels-idx1-ubyte.gz"),
)
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot"]


def debian_folder(data: DebianData) -> Path:
    """``data``'s folder, its package installed first when a file of it is missing."""
    if data.present():
        return data.folder
    command = ["apt-get", "install", "-y", "-qq", data.package]
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            raise DataError(f"{data.folder}: the Debian package {data.package} is not installed and this user cannot "
                            f"install it; run `sudo {' '.join(command)}` (or as root) and try again")
        command = ["sudo", "-n", *command]
    if shutil.which("apt-get") is None:
        raise DataError(f"{data.folder}: the Debian package {data.package} is not installed and this system has no "
                        f"apt-get; install {data.package} (or put its files {list(data.files)} there) and try again")
    log.info("installing the Debian package %s (%s)", data.package, data.folder)
    print(f"installing the Debian package {data.package} for {data.folder}", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 and "Unable to locate package" in done.stderr + done.stdout:
        subprocess.run([*command[:command.index("apt-get")], "apt-get", "update", "-qq"], env=env, capture_output=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not data.present():
        raise DataError(f"{data.folder}: installing the Debian package {data.package} failed (`{' '.join(command)}` "
                        f"exited with code {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}); install "
                        f"it and try again")
    return data.folder


def link_files(data: DebianData, into: Path) -> Path:
    """``into`` holding symbolic links to ``data``'s files (installed first when missing): an input folder of the
    project's own, made complete or not at all."""
    source = debian_folder(data)
    into = Path(into)
    staging = into.with_name(f".{into.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in data.files:
        (staging / name).symlink_to(source / name)
    staging.rename(into)
    return into

"""Secrets of a deployment, generated on the machine that runs it and never committed.

``make stack-env`` writes the compose file's env file (``.env`` beside ``docker-compose.yml``): database,
broker and object-store passwords, the Airflow admin password, the Fernet key, the JWT secret and Ray's
token. An existing file is kept (its secrets already encrypt data), with what it lacks appended; ``--force``
replaces it.
"""

from __future__ import annotations

import argparse
import base64
import os
import secrets
import sys
from pathlib import Path

# Every variable docker-compose.yml requires (``${NAME:?...}``), with how each is made.
GENERATED = {
    "POSTGRES_PASSWORD": lambda: secrets.token_urlsafe(24),
    "REDIS_PASSWORD": lambda: secrets.token_urlsafe(24),
    "MINIO_ROOT_USER": lambda: "pipeline-" + secrets.token_hex(4),
    "MINIO_ROOT_PASSWORD": lambda: secrets.token_urlsafe(24),
    "AIRFLOW_ADMIN_PASSWORD": lambda: secrets.token_urlsafe(16),
    # Fernet: 32 random bytes, URL-safe base64 (what cryptography's Fernet.generate_key makes).
    "AIRFLOW_FERNET_KEY": lambda: base64.urlsafe_b64encode(os.urandom(32)).decode(),
    # Airflow signs API and task tokens with it: 64 bytes or more.
    "AIRFLOW_JWT_SECRET": lambda: secrets.token_hex(64),
    # Ray's token authentication (the Ray services, and the password of the ray_default connection); Ray's
    # own generator makes 32 random bytes in hex.
    "RAY_AUTH_TOKEN": lambda: secrets.token_hex(32),
}


def env_text(uid: int | None = None) -> str:
    lines = ["# Secrets of this deployment (make stack-env). Keep private; never commit."]
    lines += [f"{name}={make()}" for name, make in GENERATED.items()]
    # Files on the volumes belong to this user: the caller's, but never root (then the image's user).
    uid = os.getuid() if uid is None else uid
    lines.append(f"AIRFLOW_UID={uid or 50000}")
    return "\n".join(lines) + "\n"


def write_env_file(path: Path, force: bool = False) -> bool:
    """Write a fresh env file at ``path`` (mode 0600); False when one exists and ``force`` is not set (the
    variables it lacks, from a version before them, are appended; its values are kept)."""
    path = Path(path)
    if path.exists() and not force:
        add_missing(path)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(env_text())
    os.replace(tmp, path)
    return True


def add_missing(path: Path) -> list[str]:
    """Append the generated variables that the env file at ``path`` lacks; returns their names."""
    missing = [name for name in GENERATED if name not in read_env_file(path)]
    if missing:
        text = Path(path).read_text()
        with open(path, "a") as out:
            out.write(("\n" if text and not text.endswith("\n") else "")
                      + "".join(f"{name}={GENERATED[name]()}\n" for name in missing))
    return missing


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"{path}:{number}: expected NAME=VALUE, found {line!r}")
        name, value = line.split("=", 1)
        out[name.strip()] = value.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.dev.stack.secrets", description=__doc__)
    parser.add_argument("path", nargs="?", default=".env", help="env file to write (default .env)")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args(argv)
    path = Path(args.path)
    added = add_missing(path) if path.exists() and not args.force else []
    if write_env_file(path, args.force):
        print(f"wrote {args.path} (mode 0600): docker compose reads it from beside docker-compose.yml")
    else:
        print(f"{args.path} exists; kept (--force replaces it, and the data its keys encrypted becomes unreadable)"
              + (f"; added what it lacked: {', '.join(added)}" if added else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

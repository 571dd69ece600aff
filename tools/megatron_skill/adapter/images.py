"""Container image references, written the way each runtime reads them.

Users name an image the way they know it: a registry reference (``nvcr.io/nvidia/pytorch:26.01-py3``),
one with a scheme (``docker://...``), enroot's own form (``nvcr.io#nvidia/pytorch:26.01-py3``), a Docker
Hub name without a registry (``ubuntu:24.04``) or a local file (``.sqsh`` for enroot, ``.sif`` for
Apptainer). The runtimes read them differently:

- Pyxis (``srun --container-image``) takes enroot's URI without its scheme,
  ``[USER@][REGISTRY#]IMAGE[:TAG]``, or a squashfs file; it takes a value that starts with ``.``
  or ``/`` for a file and anything else for a registry image. Without ``REGISTRY#`` enroot pulls
  from Docker Hub; ``nvcr.io/nvidia/pytorch`` would be read as a Docker Hub image of that name.
- Apptainer and Singularity (``apptainer exec IMAGE``) take a URI with a scheme
  (``docker://REGISTRY/IMAGE:TAG``, ``library://``, ``oras://``, ...) or a local file (``.sif``);
  a value without a scheme is a path.
- Kubernetes takes a plain Docker reference (``REGISTRY/IMAGE:TAG``).

``for_runtime`` turns any of these into the form of one runtime, or raises a bad request that
says what to give instead.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ToolError

DOCKER_HUB_HOSTS = ("docker.io", "index.docker.io", "registry-1.docker.io")
SQUASHFS_SUFFIXES = (".sqsh", ".squashfs")
SIF_SUFFIXES = (".sif",)
# Schemes Apptainer pulls itself; enroot's local-daemon schemes, which Pyxis never passes on.
APPTAINER_SCHEMES = ("docker", "library", "oras", "shub", "docker-archive", "docker-daemon", "oci",
                     "oci-archive", "http", "https")
ENROOT_ONLY_SCHEMES = ("dockerd", "podman")
SCHEME = re.compile(r"^([a-z][a-z0-9+-]*)://(.*)$")
# enroot's import grammar: repository names lower case, tags of letters, digits, '.', '_', ':' and '-'.
ENROOT_IMAGE = re.compile(r"^[a-z0-9/._-]+$")
ENROOT_TAG = re.compile(r"^[A-Za-z0-9._:-]+$")
RUNTIMES = ("pyxis", "apptainer", "singularity", "kubernetes")


@dataclass(frozen=True)
class ImageRef:
    """A registry image: registry host ('' for Docker Hub), repository, tag, digest, enroot user."""
    registry: str
    repository: str
    tag: str = ""
    digest: str = ""
    user: str = ""

    def docker(self) -> str:
        """REGISTRY/IMAGE[:TAG][@DIGEST], Docker's and Kubernetes' form."""
        name = f"{self.registry}/{self.repository}" if self.registry else self.repository
        return name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    def enroot(self) -> str:
        """[USER@][REGISTRY#]IMAGE[:TAG], enroot's URI without its docker:// scheme (Pyxis' form)."""
        head = (f"{self.user}@" if self.user else "") + (f"{self.registry}#" if self.registry else "")
        return head + self.repository + (f":{self.tag}" if self.tag else "")


def _bad(message: str, fix: str) -> ToolError:
    return ToolError("bad_request", message, fix=fix)


def _is_registry_host(part: str) -> bool:
    """Docker's rule: the first part of a reference is a registry host when it holds a '.' or a
    ':' (a port), or is localhost; otherwise the reference is a Docker Hub repository."""
    return "." in part or ":" in part or part == "localhost"


def _split_tag_digest(rest: str) -> tuple[str, str, str]:
    """repository, tag, digest of 'repo[:tag][@digest]' (a ':' after the last '/' starts the tag)."""
    rest, _, digest = rest.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1:], digest
    return rest, "", digest


def parse_docker(text: str) -> ImageRef:
    """A Docker reference (REGISTRY/IMAGE[:TAG][@DIGEST], or a Docker Hub IMAGE[:TAG])."""
    first, sep, rest = text.partition("/")
    if sep and _is_registry_host(first):
        registry, remainder = first, rest
    else:
        registry, remainder = "", text
    if registry in DOCKER_HUB_HOSTS:
        registry = ""
    repository, tag, digest = _split_tag_digest(remainder)
    if not repository or repository.startswith("/") or repository.endswith("/"):
        raise _bad(f"{text!r} names no image", "give REGISTRY/IMAGE:TAG, e.g. nvcr.io/nvidia/pytorch:26.01-py3")
    return ImageRef(registry, repository, tag, digest)


def parse_enroot(text: str) -> ImageRef:
    """enroot's [USER@][REGISTRY#]IMAGE[:TAG]."""
    user, registry, rest = "", "", text
    if "#" in rest:
        head, _, rest = rest.partition("#")
        user, _, registry = head.rpartition("@")
    if registry in DOCKER_HUB_HOSTS:
        registry = ""
    repository, tag, digest = _split_tag_digest(rest)
    if not repository:
        raise _bad(f"{text!r} names no image", "give REGISTRY#IMAGE:TAG, e.g. nvcr.io#nvidia/pytorch:26.01-py3")
    return ImageRef(registry, repository, tag, digest, user)


def _is_file(text: str) -> bool:
    lower = text.lower()
    return text.startswith(("/", "./", "../")) or lower.endswith(SQUASHFS_SUFFIXES + SIF_SUFFIXES)


def _registry_image(text: str) -> ImageRef:
    """A registry image in any of the forms users give (docker://, enroot's '#', plain)."""
    if text.startswith("docker://"):
        text = text[len("docker://"):]
    return parse_enroot(text) if "#" in text else parse_docker(text)


def _for_pyxis(text: str) -> str:
    scheme = SCHEME.match(text)
    if _is_file(text) and not scheme:
        if text.lower().endswith(SIF_SUFFIXES):
            raise _bad(f"{text} is an Apptainer image (.sif), which Pyxis/enroot cannot run",
                       "give the registry image it was built from (e.g. nvcr.io/nvidia/pytorch:26.01-py3), a "
                       "squashfs file made with `enroot import -o IMAGE.sqsh docker://REGISTRY#IMAGE:TAG`, or "
                       "use runtime apptainer")
        return text if text.startswith(("/", ".")) else "./" + text  # Pyxis reads a file only so
    if scheme and scheme.group(1) != "docker":
        raise _bad(f"Pyxis pulls registry images only; {scheme.group(1)}:// is not one of them",
                   "give a registry image (REGISTRY/IMAGE:TAG) or a .sqsh file, or use runtime apptainer"
                   if scheme.group(1) not in ENROOT_ONLY_SCHEMES else
                   "import it first (`enroot import -o IMAGE.sqsh " + text + "`) and give the .sqsh file")
    ref = _registry_image(text)
    if ref.digest:
        raise _bad(f"{text}: enroot's image URI takes a tag, not a digest (@{ref.digest.split(':')[0]}:...)",
                   "give the tag (IMAGE:TAG), or import the image by digest elsewhere and give its .sqsh file")
    if not ENROOT_IMAGE.match(ref.repository):
        raise _bad(f"{text}: enroot reads image names of lower-case letters, digits, '/', '.', '_' and '-' only",
                   "write the image name in lower case, as registries store it")
    if ref.tag and not ENROOT_TAG.match(ref.tag):
        raise _bad(f"{text}: the tag {ref.tag!r} has characters enroot does not read", "use the image's tag as the "
                   "registry lists it")
    return ref.enroot()


def _for_apptainer(text: str) -> str:
    scheme = SCHEME.match(text)
    if scheme and scheme.group(1) != "docker":
        if scheme.group(1) in APPTAINER_SCHEMES:
            return text
        raise _bad(f"Apptainer cannot pull {scheme.group(1)}:// images (an enroot scheme)",
                   "give docker://REGISTRY/IMAGE:TAG or a .sif file")
    if _is_file(text) and not scheme:
        if text.lower().endswith(SQUASHFS_SUFFIXES):
            raise _bad(f"{text} is an enroot squashfs image, which Apptainer does not run",
                       "give docker://REGISTRY/IMAGE:TAG, or build a .sif (`apptainer build IMAGE.sif "
                       "docker://REGISTRY/IMAGE:TAG`) and give that file, or use runtime pyxis")
        return text
    ref = _registry_image(text)
    if ref.user:
        raise _bad(f"{text}: a docker:// reference carries no user",
                   "drop USER@ and log in once with `apptainer registry login docker://REGISTRY`")
    return "docker://" + ref.docker()


def _for_kubernetes(text: str) -> str:
    scheme = SCHEME.match(text)
    if _is_file(text) or (scheme and scheme.group(1) != "docker"):
        raise _bad(f"{text} is not a registry image, which is all a pod can pull",
                   "give REGISTRY/IMAGE:TAG (push the image to a registry the cluster reaches)")
    ref = _registry_image(text)
    if ref.user:
        raise _bad(f"{text}: a pod's image carries no user", "drop USER@ and give the cluster an imagePullSecret")
    return ref.docker()


def for_runtime(image: str, runtime: str, where: str = "/container/image") -> str:
    """The image as `runtime` (pyxis, apptainer, singularity, kubernetes) reads it; a bad request
    at `where` for one it cannot run."""
    convert = {"pyxis": _for_pyxis, "apptainer": _for_apptainer, "singularity": _for_apptainer,
               "kubernetes": _for_kubernetes}.get(runtime)
    if convert is None:
        raise ValueError(f"unknown container runtime {runtime!r}; one of {RUNTIMES}")
    try:
        return convert(image.strip())
    except ToolError as e:
        e.where = where
        raise

"""Container image references: each form a user gives, written the way the runtime reads it
(enroot's URI `[USER@][REGISTRY#]IMAGE[:TAG]` for Pyxis, `docker://` or a file for Apptainer, a
plain reference for Kubernetes), or refused with what to give instead."""
import re

import pytest

from megatron_skill.adapter.images import for_runtime, parse_docker, parse_enroot
from megatron_skill.errors import ToolError

# enroot's own parse of an import URI (its docker import's pattern, written out here): what Pyxis
# builds from --container-image by putting docker:// in front.
ENROOT_URI = re.compile(r"^docker://(([A-Za-z0-9_.!~*'()%;:&=+$,-]+)@)?(([^#]+)#)?([a-z0-9/._-]+)(:([A-Za-z0-9._:-]+))?$")

PYXIS = [
    ("nvcr.io/nvidia/pytorch:26.01-py3", "nvcr.io#nvidia/pytorch:26.01-py3"),
    ("docker://nvcr.io/nvidia/pytorch:26.01-py3", "nvcr.io#nvidia/pytorch:26.01-py3"),
    ("nvcr.io#nvidia/pytorch:26.01-py3", "nvcr.io#nvidia/pytorch:26.01-py3"),
    ("docker://nvcr.io#nvidia/pytorch:26.01-py3", "nvcr.io#nvidia/pytorch:26.01-py3"),
    ("$oauthtoken@nvcr.io#nvidia/pytorch:26.01-py3", "$oauthtoken@nvcr.io#nvidia/pytorch:26.01-py3"),
    ("ubuntu:24.04", "ubuntu:24.04"),                         # Docker Hub: enroot's default registry
    ("pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel", "pytorch/pytorch:2.9.0-cuda12.8-cudnn9-devel"),
    ("docker.io/library/ubuntu:24.04", "library/ubuntu:24.04"),  # docker.io serves no registry API itself
    ("registry.example.com:5000/team/train:v1", "registry.example.com:5000#team/train:v1"),
    ("localhost/train", "localhost#train"),
    ("ghcr.io/org/image", "ghcr.io#org/image"),
    ("/shared/images/pytorch.sqsh", "/shared/images/pytorch.sqsh"),
    ("images/pytorch.sqsh", "./images/pytorch.sqsh"),            # Pyxis takes a file only from . or /
    ("./pytorch.sqsh", "./pytorch.sqsh"),
]


@pytest.mark.parametrize("given,expected", PYXIS)
def test_pyxis_gets_enroots_form_or_a_file_it_recognises(given, expected):
    out = for_runtime(given, "pyxis")
    assert out == expected
    if not out.startswith(("/", ".")):
        assert ENROOT_URI.match("docker://" + out), out


APPTAINER = [
    ("nvcr.io/nvidia/pytorch:26.01-py3", "docker://nvcr.io/nvidia/pytorch:26.01-py3"),
    ("nvcr.io#nvidia/pytorch:26.01-py3", "docker://nvcr.io/nvidia/pytorch:26.01-py3"),
    ("docker://nvcr.io/nvidia/pytorch:26.01-py3", "docker://nvcr.io/nvidia/pytorch:26.01-py3"),
    ("ubuntu:24.04", "docker://ubuntu:24.04"),
    ("nvcr.io/nvidia/pytorch@sha256:" + "a" * 64, "docker://nvcr.io/nvidia/pytorch@sha256:" + "a" * 64),
    ("/shared/images/pytorch.sif", "/shared/images/pytorch.sif"),
    ("pytorch.sif", "pytorch.sif"),
    ("library://org/collection/image:tag", "library://org/collection/image:tag"),
    ("oras://ghcr.io/org/image:tag", "oras://ghcr.io/org/image:tag"),
]


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
@pytest.mark.parametrize("given,expected", APPTAINER)
def test_apptainer_gets_a_uri_with_its_scheme_or_a_file(given, expected, runtime):
    assert for_runtime(given, runtime) == expected


REFUSED = [
    ("pyxis", "/shared/images/pytorch.sif", "Apptainer image", "enroot import"),
    ("pyxis", "library://org/collection/image:tag", "registry images only", "runtime apptainer"),
    ("pyxis", "dockerd://pytorch:latest", "registry images only", ".sqsh"),
    ("pyxis", "nvcr.io/nvidia/pytorch@sha256:" + "a" * 64, "not a digest", "tag"),
    ("pyxis", "nvcr.io/NVIDIA/PyTorch:26.01-py3", "lower-case", "lower case"),
    ("apptainer", "/shared/images/pytorch.sqsh", "squashfs", "apptainer build"),
    ("apptainer", "podman://pytorch:latest", "enroot scheme", "docker://"),
    ("apptainer", "$oauthtoken@nvcr.io#nvidia/pytorch:26.01-py3", "no user", "registry login"),
    ("kubernetes", "/shared/images/pytorch.sif", "not a registry image", "REGISTRY/IMAGE:TAG"),
]


@pytest.mark.parametrize("runtime,given,message,fix", REFUSED)
def test_what_a_runtime_cannot_run_is_refused_with_the_fix(runtime, given, message, fix):
    with pytest.raises(ToolError) as err:
        for_runtime(given, runtime, where="/container/image")
    assert err.value.code == "bad_request" and err.value.where == "/container/image"
    assert message in err.value.message and fix in err.value.fix


def test_kubernetes_gets_a_plain_docker_reference():
    assert for_runtime("docker://nvcr.io/nvidia/pytorch:26.01-py3", "kubernetes") == "nvcr.io/nvidia/pytorch:26.01-py3"
    assert for_runtime("nvcr.io#nvidia/pytorch:26.01-py3", "kubernetes") == "nvcr.io/nvidia/pytorch:26.01-py3"


def test_the_two_grammars_agree_on_the_parts():
    docker = parse_docker("nvcr.io/nvidia/pytorch:26.01-py3")
    enroot = parse_enroot("nvcr.io#nvidia/pytorch:26.01-py3")
    assert docker == enroot
    assert (docker.registry, docker.repository, docker.tag) == ("nvcr.io", "nvidia/pytorch", "26.01-py3")
    hub = parse_docker("pytorch/pytorch")
    assert (hub.registry, hub.repository, hub.tag) == ("", "pytorch/pytorch", "")

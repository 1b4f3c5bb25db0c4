"""docker/ checked without a Docker engine, on what decides whether the stack runs: the images' entry points and
the compose file's services, environment and volumes (parsed with PyYAML). Names are checked against farmflow and
Prefect themselves (pools, settings, CLI options, the store URI), so a rename there fails here."""

from __future__ import annotations

import re
import shlex
from fnmatch import fnmatch
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
# ${VAR}, ${VAR:-default}; $$ escapes a dollar sign for the container
VAR = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")
ONE_SHOT = ("minio-init", "deployments")
WORKERS = {"cpu-worker": "cpu_pool", "gpu-worker": "gpu_pool"}
IMAGES = {"Dockerfile.cpu": "cpu_pool", "Dockerfile.gpu": "gpu_pool"}


def resolved(value: str) -> str:
    """What compose makes of a value when no variable is set: ${VAR:-default} -> default, $$ -> $."""
    return VAR.sub(lambda m: m.group(2) or "", value).replace("$$", "$")


def env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in (SERVICES[service].get("environment") or {}).items()}


def argv(value) -> list[str]:
    return shlex.split(value) if isinstance(value, str) else [resolved(str(v)) for v in value or []]


def option(args: list[str], name: str) -> str | None:
    return next((args[i + 1] for i in range(len(args) - 1) if args[i] == name), None)


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / dockerfile).read_text())
    return [tuple(ln.split(None, 1)) for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def image_env(dockerfile: str) -> dict[str, str]:
    return {k: v for ins, args in instructions(dockerfile) if ins == "ENV" for k, v in re.findall(r"(\w+)=(\S+)", args)}


def pool(field: str) -> str:
    from farmflow.config import ExecutionConfig

    return getattr(ExecutionConfig(), field)


def worker_start(args: list[str]) -> None:
    """Parse `prefect worker start ARGS` with Prefect's own CLI (raises on an unknown option)."""
    from prefect.cli.worker import worker_app

    worker_app.parse_args(["start", *args], exit_on_error=False, print_error=False)


# ------------------------------------------------------------------------------ the images
@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_image_starts_a_worker_on_its_farmflow_pool(dockerfile):
    last = {ins: args for ins, args in instructions(dockerfile)}  # the last ENTRYPOINT and CMD count
    assert yaml.safe_load(last["ENTRYPOINT"]) == ["prefect", "worker", "start"]
    cmd = yaml.safe_load(last["CMD"])
    worker_start(cmd)
    assert option(cmd, "--pool") == pool(IMAGES[dockerfile])


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_image_runs_as_a_user_with_its_caches_in_the_volume(dockerfile):
    steps = instructions(dockerfile)
    user = [args for ins, args in steps if ins == "USER"]
    assert user and user[-1].split(":")[0] not in ("0", "root")
    volumes = [v for ins, args in steps if ins == "VOLUME" for v in yaml.safe_load(args)]
    variables = image_env(dockerfile)
    for name in ("HF_HOME", "FARMFLOW_CACHE"):
        assert any(variables[name].startswith(v + "/") for v in volumes), name
    assert variables["PREFECT_HOME"].startswith("/home/") and variables["PREFECT_LOGGING_EXTRA_LOGGERS"] == "farmflow"


def test_one_torch_version_everywhere():
    """The CPU image's wheel, the GPU base image and the Makefile's install are the same torch."""
    cpu = re.search(r"torch==(\S+)", (DOCKER / "Dockerfile.cpu").read_text()).group(1)
    gpu = re.search(r"BASE_IMAGE=pytorch/pytorch:([\d.]+)-", (DOCKER / "Dockerfile.gpu").read_text()).group(1)
    make = re.search(r"^\t.*pip install .*?torch==(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert cpu == gpu == make


IGNORED = (
    ".git/config",
    ".venv/bin/python",
    ".farmflow/store/sft",
    ".env",
    "docker/.env",
    "src/farmflow/__pycache__/x.pyc",
    "data/alpaca.json",
)
KEPT = ("src/farmflow/data/alpaca.py", "pyproject.toml", "constraints.txt", "README.md")


@pytest.mark.parametrize("path", IGNORED + KEPT)
def test_dockerignore_keeps_secrets_and_local_state_out_of_the_build(path):
    """Patterns are anchored at the context root (`data` is not src/farmflow/data); `**/x` matches at any depth."""
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and ln[0] != "#"]
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    hit = any(
        any(fnmatch(p, pat[3:]) for p in parts) if pat.startswith("**/") else any(fnmatch(p, pat) for p in prefixes)
        for pat in patterns
    )
    assert hit == (path in IGNORED)


# ------------------------------------------------------------------------------ the compose file
@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_image_is_pinned_or_built_here(service):
    svc = SERVICES[service]
    if "build" in svc:
        assert (ROOT / "docker" / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve().is_file()
    assert re.search(r":(.*\d+[.-]\d+)", svc["image"]), svc["image"]  # 17.6-alpine, RELEASE.2025-..., 0.1.0: not latest


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_service_restarts_unless_it_is_a_one_shot(service):
    assert SERVICES[service]["restart"] == ("no" if service in ONE_SHOT else "unless-stopped")
    assert ("healthcheck" in SERVICES[service]) == (service not in ONE_SHOT)


@pytest.mark.parametrize("service", sorted(s for s in SERVICES if "depends_on" in SERVICES[s]))
def test_service_waits_for_healthy_or_finished_dependencies(service):
    for dep, how in SERVICES[service]["depends_on"].items():
        assert how["condition"] == ("service_completed_successfully" if dep in ONE_SHOT else "service_healthy"), dep


@pytest.mark.parametrize("service", sorted(s for s in SERVICES if "ports" in SERVICES[s]))
def test_ports_are_published_on_loopback_only(service):
    assert all(resolved(p).startswith("127.0.0.1:") for p in SERVICES[service]["ports"])


@pytest.mark.parametrize("service", sorted(s for s in SERVICES if "volumes" in SERVICES[s]))
def test_volumes_are_declared_or_read_only_bind_mounts(service):
    for volume in SERVICES[service]["volumes"]:
        source, target, *mode = resolved(volume).split(":")
        assert source in COMPOSE["volumes"] or (source.startswith(".") and mode == ["ro"]), volume
        assert target.startswith("/")


@pytest.mark.parametrize("worker", sorted(WORKERS))
def test_worker_polls_its_farmflow_pool_with_options_prefect_accepts(worker):
    cmd = argv(SERVICES[worker]["command"])
    worker_start(cmd)
    assert option(cmd, "--pool") == pool(WORKERS[worker])
    assert set(SERVICES[worker]["depends_on"]) == {"prefect-server", "minio-init", "deployments"}


def test_the_gpu_worker_reserves_an_nvidia_gpu():
    (device,) = SERVICES["gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_worker_pools_are_the_pools_farmflow_deploy_registers():
    """`farmflow deploy` as the deployments service calls it: farmflow's parser accepts it; its pools are polled."""
    import typer

    from farmflow.cli import app
    from farmflow.config import load_config
    from farmflow.deployments import deployments

    args = argv(SERVICES["deployments"]["command"])
    params = typer.main.get_command(app).commands[args[0]].make_context(args[0], args[1:]).params
    load_config(params["preset"], list(params["set_"]))  # every --set names a field farmflow has
    pools = {d.work_pool_name for d in deployments(params["preset"])}
    polled = {option(argv(SERVICES[w]["command"]), "--pool") for w in WORKERS}
    assert pools == polled == {"farmflow-cpu", "farmflow-gpu"}


@pytest.mark.parametrize("service", sorted(s for s in SERVICES if "FARMFLOW_STORE" in env(s)))
def test_store_api_and_keys_point_at_the_stack(service):
    variables = {k: resolved(v) for k, v in env(service).items()}
    store = urlsplit(variables["FARMFLOW_STORE"])
    bucket = re.search(r"mb --ignore-existing \w+/(\S+)", " ".join(SERVICES["minio-init"]["command"])).group(1)
    assert store.scheme == "s3" and store.netloc == bucket and store.query == "endpoint_url=http://minio:9000"
    assert variables["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env(service)["AWS_ACCESS_KEY_ID"] == env("minio")["MINIO_ROOT_USER"]
    assert env(service)["AWS_SECRET_ACCESS_KEY"] == env("minio")["MINIO_ROOT_PASSWORD"]


def test_farmflow_reads_the_variables_the_compose_file_sets(monkeypatch, s3_server):
    from farmflow.config import StoreConfig
    from farmflow.storage.s3 import S3Store

    store = resolved(env("cpu-worker")["FARMFLOW_STORE"])
    monkeypatch.setenv("FARMFLOW_STORE", store)
    assert StoreConfig().uri == store
    cache = image_env("Dockerfile.cpu")["FARMFLOW_CACHE"]  # where an S3 store keeps the models it downloads
    monkeypatch.setenv("FARMFLOW_CACHE", cache)
    assert S3Store(f"s3://{s3_server.bucket()}/x?endpoint_url={s3_server.endpoint}").cache == Path(cache)


PREFECT_VARIABLES = sorted(
    {k for s in SERVICES for k in env(s) if k.startswith("PREFECT_")}
    | {k for d in IMAGES for k in image_env(d) if k.startswith("PREFECT_")}
)


@pytest.mark.parametrize("name", PREFECT_VARIABLES)
def test_prefect_reads_every_prefect_variable(monkeypatch, name):
    from prefect.settings import Settings

    given = [*(env(s).get(name) for s in SERVICES), *(image_env(d).get(name) for d in IMAGES)]
    value = next(resolved(v) for v in given if v)
    monkeypatch.setenv(name, value)
    settings = Settings().to_environment_variables(include_aliases=True)
    assert str(settings[name]).lower() in (value.lower(), f'["{value}"]'.lower())


def strings(node) -> list[str]:
    """Every string value of the parsed compose file."""
    if isinstance(node, dict):
        return [s for v in node.values() for s in strings(v)]
    return [s for v in node for s in strings(v)] if isinstance(node, list) else [node] if isinstance(node, str) else []


REFERENCES = [m for text in strings(COMPOSE) for m in VAR.findall(text)]  # (name, default)


@pytest.mark.parametrize("name", sorted({n for n, _ in REFERENCES}))
def test_variable_is_documented_with_one_default(name):
    lines = (DOCKER / ".env.example").read_text().splitlines()
    documented = {ln.split("=", 1)[0] for ln in lines if re.match(r"^[A-Z_]+=", ln)}
    assert name in documented
    assert len({d for n, d in REFERENCES if n == name}) == 1  # every use falls back to the same value


SECRETS = sorted((s, k) for s in SERVICES for k in env(s) if re.search(r"KEY|SECRET|PASSWORD|TOKEN", k))


@pytest.mark.parametrize("service, name", SECRETS, ids=[f"{s}-{k}" for s, k in SECRETS])
def test_secrets_come_from_the_environment(service, name):
    """A secret is a ${VAR} reference (never a literal); an API key or token has no default; only the CPU worker,
    which annotates, gets the OpenAI key."""
    (ref,) = VAR.findall(env(service)[name]) or [None]
    assert ref is not None, f"{service}: {name} holds a literal value"
    if re.search(r"API_KEY|TOKEN", name):
        assert ref[1] == ""
    assert name != "OPENAI_API_KEY" or service == "cpu-worker"

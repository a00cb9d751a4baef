"""The real agent CLIs (Claude Code, Codex, OpenCode): pinned, installed from npm into a
cache, and driven non-interactively against a kvagent router through a recording proxy.

Plain functions, no pytest, so a shell can use them too:

    python tests/agents/clis.py install            # every pinned CLI into the cache
    python tests/agents/clis.py path codex         # where the cached `codex` is

`ensure_cli("codex")` installs a pinned CLI once (`npm install` of the pinned version into
`~/.cache/kvagent/npm/<name>-<version>`, see `cache_dir`) and returns its
executable; later calls reuse the cached copy. Only the npm registry that `~/.npmrc` names
is contacted: each CLI's native binary is one of its platform-specific optional
dependencies, which npm installs from the same registry (their postinstall scripts only
link that binary into place).

`Recorder` is a reverse proxy in front of the router: the CLI talks to it as to the router,
and it keeps every request (method, path, headers, body) with the status and the answer,
so a test can say what the CLI really sent and what each request reused.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

#: Where installed CLIs are kept (one folder per name and version); by default `npm/` in
#: kvagent's cache (`$KVAGENT_CACHE_DIR`, else `~/.cache/kvagent`, beside the demo models).
CACHE_ENV = "KVAGENT_NPM_CACHE"
#: How long one `npm install` may take (the CLIs' native binaries are 100-400 MB).
INSTALL_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Pin:
    """One CLI at one version: the npm package and the executable it installs."""

    package: str
    version: str
    bin: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


#: The CLIs the suite runs, at the versions it was checked against. Change a version here
#: and nowhere else.
PINS: dict[str, Pin] = {
    "claude": Pin("@anthropic-ai/claude-code", "2.1.328", "claude"),
    "codex": Pin("@openai/codex", "0.169.0", "codex"),
    "opencode": Pin("opencode-ai", "1.18.33", "opencode"),
}


class InstallError(RuntimeError):
    """A pinned CLI could not be installed or does not run."""


def cache_dir() -> Path:
    from kvagent_server.models.cache import default_cache_dir

    return Path(os.environ.get(CACHE_ENV) or default_cache_dir() / "npm")


def install_dir(name: str) -> Path:
    pin = PINS[name]
    return cache_dir() / f"{name}-{pin.version}"


def _executable(name: str) -> Path:
    return install_dir(name) / "node_modules" / ".bin" / PINS[name].bin


def _version_ok(name: str, exe: Path) -> bool:
    try:
        with tempfile.TemporaryDirectory() as home:  # whatever it writes on start goes too
            out = subprocess.run([str(exe), "--version"], check=False, capture_output=True,
                                 text=True, timeout=60, env=base_env(Path(home)))
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and PINS[name].version in out.stdout


def ensure_cli(name: str) -> Path:
    """The pinned CLI's executable, installed into the cache on first use.

    Raises `InstallError` (with npm's output) when npm is missing, the install fails, or the
    installed CLI does not report its pinned version."""
    if name not in PINS:
        raise KeyError(f"no pinned CLI {name!r}; known: {', '.join(PINS)}")
    exe = _executable(name)
    if exe.exists() and _version_ok(name, exe):
        return exe
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError(f"npm is not on PATH: cannot install {PINS[name].spec}")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer per CLI; the others wait, then reuse
        if exe.exists() and _version_ok(name, exe):
            return exe
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            _npm_install(npm, name, staging)
            target = install_dir(name)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not (exe.exists() and _version_ok(name, exe)):
        raise InstallError(f"{PINS[name].spec} installed into {install_dir(name)}, but "
                           f"`{exe} --version` does not say {PINS[name].version}")
    return exe


def _npm_install(npm: str, name: str, prefix: Path) -> None:
    pin = PINS[name]
    argv = [npm, "install", "--prefix", str(prefix), "--no-save", "--no-package-lock",
            "--no-audit", "--no-fund", "--loglevel=warn", pin.spec]
    try:
        out = subprocess.run(argv, check=False, capture_output=True, text=True,
                             timeout=INSTALL_TIMEOUT_S, cwd=prefix)
    except subprocess.TimeoutExpired as exc:
        raise InstallError(f"`{' '.join(argv)}` ran over {INSTALL_TIMEOUT_S:.0f}s") from exc
    if out.returncode != 0:
        raise InstallError(f"`{' '.join(argv)}` failed ({out.returncode}):\n"
                           f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


# ------------------------------------------------------------------------ running a CLI


@dataclass
class Run:
    """One CLI invocation: its command line, exit status, output and wall time."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    def summary(self) -> str:
        cmd = " ".join(a if len(a) < 80 else a[:77] + "..." for a in self.argv)
        return (f"$ {cmd}\n(exit {self.returncode}, {self.seconds:.1f}s"
                f"{', TIMED OUT' if self.timed_out else ''})\n"
                f"--- stdout (end)\n{self.stdout[-4000:]}\n--- stderr (end)\n{self.stderr[-4000:]}")

    def json_lines(self) -> list[dict[str, Any]]:
        """stdout's JSON objects, one a line (other lines skipped)."""
        out = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out


def run(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> Run:
    """Runs a CLI in its own process group with no stdin; on timeout the whole group is
    killed (the CLIs start helpers of their own), and the run says so."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:
            _kill_group(proc)
    return Run(argv=argv, returncode=proc.returncode, stdout=stdout, stderr=stderr,
               seconds=time.monotonic() - start, timed_out=timed_out)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def base_env(home: Path) -> dict[str, str]:
    """A clean environment with a throw-away home: nothing from the caller's agent
    configuration (keys, base URLs, config folders) leaks in, and nothing is written to
    the real home."""
    for sub in (".config", ".cache", ".local/share", ".local/state", "tmp"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    node_bin = str(Path(shutil.which("node") or "/usr/bin/node").parent)
    return {
        "PATH": os.pathsep.join(dict.fromkeys([node_bin, "/usr/local/bin", "/usr/bin", "/bin"])),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_DATA_HOME": str(home / ".local/share"),
        "XDG_STATE_HOME": str(home / ".local/state"),
        # Inside the home: Codex refuses to put helpers in its home when that lies under
        # the temp folder, and nothing a CLI leaves in its temp folder outlives the test.
        "TMPDIR": str(home / "tmp"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
    }


# --------------------------------------------------------------------------- the proxy


#: Request headers a proxy must not forward as they are.
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
        "accept-encoding"}


@dataclass
class Exchange:
    """One request the CLI sent and what the router answered."""

    method: str
    path: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    status: int = 0
    answer: str = ""  # the response body (SSE text or JSON), at most `Recorder.keep` bytes
    mark: int = 0  # which `Recorder.mark()` it came after: the CLI invocation
    client_closed: bool = False  # the CLI hung up before the answer's end

    @property
    def json(self) -> Any:
        try:
            return json.loads(self.body) if self.body else None
        except ValueError:
            return None

    @property
    def is_upgrade(self) -> bool:
        """A WebSocket upgrade attempt (Codex tries one first, then falls back to HTTP)."""
        return self.headers.get("upgrade", "").lower() == "websocket"

    @property
    def kvagent(self) -> dict[str, Any] | None:
        """The router's reuse report in the answer (the last `"kvagent": {...}` in it)."""
        at = self.answer.rfind('"kvagent":')
        if at < 0:
            return None
        start = at + len('"kvagent":')
        start += len(self.answer[start:]) - len(self.answer[start:].lstrip())
        try:
            value, _ = json.JSONDecoder().raw_decode(self.answer, start)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    @property
    def reused_tokens(self) -> int:
        report = self.kvagent or {}
        return int(report.get("reused_tokens") or 0)

    def line(self) -> str:
        report = self.kvagent or {}
        return (f"[{self.mark}] {self.method} {self.path} -> {self.status} "
                f"({len(self.body)} B; path={report.get('path')}, "
                f"reused={report.get('reused_tokens')})")


@dataclass
class Recorder:
    """A reverse proxy on a free loopback port, in front of `upstream` (the router's root
    URL), recording every exchange. Use as a context manager; `.url` is what the CLI gets."""

    upstream: str
    keep: int = 256 * 1024
    exchanges: list[Exchange] = field(default_factory=list)
    url: str = ""
    _mark: int = 0

    def mark(self) -> int:
        """Starts a new group of exchanges (call before each CLI invocation)."""
        self._mark += 1
        return self._mark

    def since(self, mark: int) -> list[Exchange]:
        return [x for x in self.exchanges if x.mark == mark]

    def __enter__(self) -> Self:
        from kvagent_server.common.ports import free_port

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(port, started), daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the recording proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _serve(self, port: int, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main(port, started))
        self._loop.close()

    async def _main(self, port: int, started: threading.Event) -> None:
        import aiohttp
        from aiohttp import web

        self._stop = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=900)
        async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as client:
            async def handle(request: web.Request) -> web.StreamResponse:
                body = await request.read()
                x = Exchange(method=request.method, path=request.path_qs,
                             headers={k.lower(): v for k, v in request.headers.items()},
                             body=body, mark=self._mark)
                self.exchanges.append(x)
                headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
                try:
                    async with client.request(request.method, self.upstream + request.path_qs,
                                              headers=headers, data=body,
                                              allow_redirects=False) as up:
                        x.status = up.status
                        out = web.StreamResponse(status=up.status, headers={
                            k: v for k, v in up.headers.items() if k.lower() not in _HOP})
                        await out.prepare(request)
                        kept = bytearray()
                        async for chunk in up.content.iter_any():
                            if len(kept) < self.keep:
                                kept += chunk[: self.keep - len(kept)]
                            x.answer = kept.decode("utf-8", "replace")
                            await _send(out, x, chunk)
                        await _send(out, x, None)
                        return out
                except (TimeoutError, aiohttp.ClientError) as exc:
                    x.status = 502
                    x.answer = f"proxy: {type(exc).__name__}: {exc}"
                    return web.Response(status=502, text=x.answer)

            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            started.set()
            await self._stop.wait()
            await runner.cleanup()


async def _send(out: Any, x: Exchange, chunk: bytes | None) -> None:
    """Passes a chunk (None: the end) on to the CLI unless it has hung up: Codex closes the
    connection once it has `response.completed`, and the router's answer is still read to
    its end and kept."""
    if x.client_closed:
        return
    try:
        await (out.write(chunk) if chunk is not None else out.write_eof())
    except ConnectionError:
        x.client_closed = True


# ------------------------------------------------------------------- each CLI's session


@dataclass
class Session:
    """How to run one CLI for a multi-turn session: its environment and one command line
    per turn (the first starts the session, the others continue the latest one)."""

    name: str
    env: dict[str, str]
    turns: list[list[str]]


def session(name: str, *, home: Path, base_url: str, model: str, api_key: str,
            prompts: list[str]) -> Session:
    """The CLI `name` at its defaults, told only the router's root URL (`base_url`, no
    `/v1`), the model and a key, as a user would tell it, with everything it writes under
    `home`. Also switched off: anything that would call a host other than the router
    (update checks, telemetry, OpenCode's model catalogue)."""
    exe = str(ensure_cli(name))
    env = base_env(home)
    first, *later = prompts
    if name == "claude":
        env.update({
            "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": api_key,
            "ANTHROPIC_MODEL": model, "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1"})
        out = ["--output-format", "json"]
        turns = [[exe, "-p", first, *out]] + [[exe, "-p", "--continue", p, *out] for p in later]
    elif name == "codex":
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(base_url, model))
        env.update({"CODEX_HOME": str(codex_home), "KVAGENT_API_KEY": api_key})
        turns = [[exe, "exec", "--json", first]] + [
            [exe, "exec", "resume", "--last", "--json", p] for p in later]
    elif name == "opencode":
        config_dir = home / ".config" / "opencode"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "opencode.json").write_text(
            json.dumps(opencode_config(base_url, model, api_key), indent=2))
        _share_npmrc(home)
        env.update({"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"})
        out = ["--format", "json"]
        turns = [[exe, "run", *out, first]] + [[exe, "run", "--continue", *out, p]
                                                for p in later]
    else:
        raise KeyError(f"no session recipe for {name!r}")
    return Session(name=name, env=env, turns=turns)


def codex_config(base_url: str, model: str) -> str:
    """`$CODEX_HOME/config.toml`: a model provider whose base URL is the router, the key
    from `KVAGENT_API_KEY`; every other setting Codex's default."""
    return (f'model = "{model}"\nmodel_provider = "kvagent"\n\n'
            f'[model_providers.kvagent]\nname = "kvagent"\nbase_url = "{base_url}/v1"\n'
            'wire_api = "responses"\nenv_key = "KVAGENT_API_KEY"\n')


def opencode_config(base_url: str, model: str, api_key: str) -> dict[str, Any]:
    """`opencode.json`: the router as an `@ai-sdk/openai-compatible` provider (bundled in
    OpenCode's binary: nothing is installed for it) and its one model as the default."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"kvagent": {
            "npm": "@ai-sdk/openai-compatible", "name": "kvagent",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": api_key},
            "models": {model: {"name": model}}}},
        "model": f"kvagent/{model}",
    }


def _share_npmrc(home: Path) -> None:
    """OpenCode installs its plugin API (`@opencode-ai/plugin`) into its config folder on
    start, in the background, with the npm configuration of its home: the throw-away home
    gets the caller's `~/.npmrc`, so that install asks the same registry as `ensure_cli`."""
    npmrc = Path.home() / ".npmrc"
    if npmrc.exists():
        shutil.copyfile(npmrc, home / ".npmrc")


def claude_result(run: Run) -> dict[str, Any]:
    """Claude Code's `--output-format json` result object ({} when it printed none)."""
    found = [o for o in run.json_lines() if o.get("type") == "result"]
    return found[-1] if found else {}


#: Codex reports a model it has no metadata for as an `error` item: a note about its own
#: model catalogue (context window, tool hints), not an error of the request.
CODEX_NOTES = ("Model metadata for",)


def surfaced_errors(name: str, run: Run) -> list[str]:
    """What the CLI showed as an error in this run (its own JSON events and stderr)."""
    errors = []
    events = run.json_lines()
    if name == "claude":
        result = claude_result(run)
        if not result:
            errors.append("no result object")
        elif result.get("is_error") or result.get("subtype") != "success" \
                or result.get("api_error"):
            errors.append(f"result: is_error={result.get('is_error')} "
                          f"api_error={result.get('api_error')} {result.get('result')!r}")
    elif name == "codex":
        for e in events:
            item = e.get("item") or {}
            note = str(item.get("message", "")).startswith(CODEX_NOTES)
            if e.get("type") in ("error", "turn.failed") or (
                    item.get("type") == "error" and not note):
                errors.append(json.dumps(e))
        if not any(e.get("type") == "turn.completed" for e in events):
            errors.append("no turn.completed event")
    elif name == "opencode":
        errors += [json.dumps(e) for e in events if e.get("type") == "error"]
        if not any(e.get("type") == "step_finish" for e in events):
            errors.append("no step_finish event")
    errors += [line for line in run.stderr.splitlines() if "error" in line.lower()]
    return errors


def cached_tokens(name: str, run: Run) -> int:
    """The cached input tokens the CLI itself reports for this run (its usage)."""
    events = run.json_lines()
    if name == "claude":
        return int((claude_result(run).get("usage") or {}).get("cache_read_input_tokens") or 0)
    if name == "codex":
        return sum(int((e.get("usage") or {}).get("cached_input_tokens") or 0)
                   for e in events if e.get("type") == "turn.completed")
    if name == "opencode":
        return sum(int((((e.get("part") or {}).get("tokens") or {}).get("cache") or {})
                       .get("read") or 0) for e in events if e.get("type") == "step_finish")
    raise KeyError(name)


#: CLIs whose usage in a resumed session counts the whole session so far, not the run.
CUMULATIVE_USAGE = frozenset({"codex"})


# ------------------------------------------------------------------------------ shell


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"]:
        for name in argv[1:] or list(PINS):
            print(f"{name}: {ensure_cli(name)}")
        return 0
    if argv[:1] == ["path"] and len(argv) == 2:
        print(ensure_cli(argv[1]))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

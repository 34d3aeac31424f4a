"""
The maintainers' checks: what CI runs beside the specification (test_all.py), one concern a file. A
student changing a component file runs test_all.py; these guard what a change can break further away.

    python -m pytest -q tests                   # every maintainers' check
    python -m pytest -q test_all.py tests       # and the specification: everything CI runs

  test_budgets.py      the reading path and its budgets, long lines, jumps past the marker, import order
  test_server.py       the HTTP server: parsing, hostile input, tokens, the folder on disk, connections
  test_client.py       the swarm client against servers that misbehave, and what it logs
  test_redis.py        the Redis store against a real redis-server, and the tests run against both stores
  test_dashboard.py    the dashboard and the reward charts
  test_attacks.py      the attacks docs/swarm.md measures, each asserting the bound it proves
  test_cli.py          the command lines: train.py's flags, launcher, Ctrl-C and end of run; sample.py's
  test_real_model.py   the real SmolLM2-135M-Instruct (a PyPI wheel) and the real ReasoningGym
  test_parity.py       reward.py's scorers against ReasoningGym's (python tests/test_parity.py N)
  test_newcomer.py     a newcomer's first run: a stop keeps each round, resume, mistakes answered early
  test_reproduce.py    reproduce.py: small runs, seeds, flags, statistics
  test_lab.py          the selection rule's registry (train.RULES) and reproduce.py's lab for a class
  test_course.py       course.py: verify, start and reset byte for byte, grading, release
  test_glossary.py     docs/glossary.md is what docs/glossary.py writes from the code

This file puts the repository on the path, hands the test files the specification's fixtures (tiny,
_sw_server, _sw_clients), the swarm server as a process of its own (_sw_spawn, _sw_stop), a stand-in
server whose every answer a test writes (fake_server), and the processes whose command line holds some
text (_processes_mentioning).
"""

import json
import os
import re
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from test_all import _sw_clients, _sw_server, tiny  # noqa: E402, F401 (fixtures: pytest finds them here)

_SW_SCRIPT = os.path.join(ROOT, "swarm.py")


def fake_server(answer):
    """A stand-in server on loopback: every GET and POST is answered by answer(method, path, body) -> (status,
    a JSON-able reply or bytes[, headers]). -> (the server, its URL); the caller shuts it down."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, reply, *headers = answer(self.command, self.path, body)
            reply = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
            self.send_response(status)
            for name, value in (headers[0] if headers else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.handle_error = lambda request, address: None  # a client that hangs up mid-reply is no news here
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def _sw_spawn(folder, log_path, *flags, preexec_fn=None):
    """python swarm.py --port 0 as a subprocess -> (process, url read from its first stdout line)."""
    proc = subprocess.Popen([sys.executable, _SW_SCRIPT, "--dir", folder, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=open(log_path, "a"), text=True, preexec_fn=preexec_fn)
    line = proc.stdout.readline().strip()
    m = re.fullmatch(r"swarm server: (http://127\.0\.0\.1:\d+)", line)
    if not m:
        proc.kill()
        proc.wait()
        raise AssertionError(f"unexpected first line {line!r}; log: {open(log_path).read()}")
    return proc, m.group(1)


def _sw_stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _processes_mentioning(*texts):
    """The ids of the processes whose command line holds every one of texts."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            if all(text.encode() in cmdline for text in texts):
                found.append(int(pid))
        except (OSError, ValueError):
            pass
    return found

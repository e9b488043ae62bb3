"""The real agent clients, at the versions setup pins, each with its default settings but the
address, complete a turn against `ferrite serve` on the embedded model: exit status 0, the
answer on stdout, and no request of theirs refused (the server log has no 4xx)."""

from conftest import client, codex_home, opencode_config, run_client


def check(done, server, name):
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert done.stdout.strip(), f"{name} printed no answer:\n{done.stderr[-2000:]}"
    assert not server.refused(), f"requests refused:\n" + "\n".join(server.refused())
    print(f"{name}: {done.seconds:.0f} s; " + "; ".join(server.generations()))


def test_claude_code_completes_a_turn(server, home):
    claude = client("claude")
    done = run_client([claude, "-p", "Say hello"], home,
                      {"ANTHROPIC_BASE_URL": server.base, "ANTHROPIC_API_KEY": "sk-local"})
    check(done, server, "claude")


def test_opencode_completes_a_turn(server, home):
    opencode = client("opencode")
    path = opencode_config(server.base, home / "work")
    done = run_client([opencode, "run", "Say hello"], home, {"OPENCODE_CONFIG": str(path)})
    check(done, server, "opencode")


def test_codex_completes_a_turn(server, home):
    codex = client("codex")
    config = codex_home(server.base, home / "home")
    done = run_client([codex, "exec", "--skip-git-repo-check", "Say hello"], home, {"CODEX_HOME": str(config)})
    check(done, server, "codex")

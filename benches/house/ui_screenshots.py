"""Screenshots of the operator page (``/ui``) at two widths, against a live ``kvmem serve``.

On ``kvmem-default`` (the real SmolLM2-135M-Instruct: the chat replies are English), or on
``tiny-llama`` with ``--quick`` (random weights: quick, and the replies are noise).

The server gets a workload an operator would see: agents of several sizes, a restart (so
some of them are warm, read from disk), the ``gossip`` scenario, a chat through the page
itself (two turns, the second hot), and a steady stream of turns while the page is open (for
the chart). Then Debian's headless Chromium (:mod:`benches.chromium`) shoots the whole page
at 1280 and 420 CSS pixels wide, with the scenario run's phases and report open:
``benches/results/ui_wide.png``, ``ui_narrow.png``, and ``ui_screenshots.md`` showing both.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benches.chromium import full_page_png, missing, open_chromium
from benches.harness import RESULTS, ResultFile, log, model_dir
from benches.server import KvmemServer

KEY = "kvmem-ui-screenshots-0123456789"
WORDS = ("cache memory agent prefix token budget restart quantized block warm hot disk batch "
         "prefill decode scenario operator tenant window stream").split()
AGENTS = {  # id -> words of its first prompt (the sizes differ, so do the bytes)
    "research-lead": 700, "planner": 420, "support-bot-7": 260, "code-reviewer": 900, "archivist": 120,
}


def _prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ". Summarize."


class Client:
    """Turns through ``POST /v1/agents/{id}/messages`` with the key; each agent's conversation kept."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, headers={"x-api-key": KEY}, timeout=300)
        self.history: dict[str, list[dict[str, str]]] = {}

    def turn(self, agent: str, text: str, *, max_tokens: int = 8) -> dict[str, Any]:
        messages = [*self.history.get(agent, []), {"role": "user", "content": text}]
        response = self.http.post(f"/v1/agents/{agent}/messages", json={"messages": messages, "max_tokens": max_tokens})
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        self.history[agent] = [*messages, {"role": "assistant", "content": result["content"]}]
        return result


def _activity(client: Client, seconds: float, stop: threading.Event) -> int:
    """Turns to a few agents, one every 0.3-1.5 s, for ``seconds`` (the chart's last minutes)."""
    rng = random.Random(7)
    deadline = time.monotonic() + seconds
    turns = 0
    while time.monotonic() < deadline and not stop.is_set():
        agent = rng.choice(["planner", "support-bot-7", "triage", "archivist"])
        client.turn(agent, _prompt(rng, rng.randint(5, 40)), max_tokens=rng.randint(4, 24))
        turns += 1
        stop.wait(rng.uniform(0.3, 1.5))
    return turns


def _chat_through_the_page(driver: Any) -> None:
    from selenium.webdriver.common.by import By

    agent = driver.find_element(By.ID, "chat-agent")
    agent.clear()
    agent.send_keys("ada")
    for text in ("Hello! I am Ada, and I keep the project notes.", "What did I say I keep?"):
        driver.execute_script("document.getElementById('chat-turn').dataset.tier = ''")
        driver.find_element(By.ID, "chat-input").send_keys(text)
        driver.find_element(By.ID, "chat-send").click()
        _until(lambda: driver.execute_script("return document.getElementById('chat-turn').dataset.tier"), 120)


def _until(condition: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError("the page did not get there")
        time.sleep(0.2)
    return value


def shoot(out: Path, *, model: str, activity_s: float) -> dict[str, Any]:
    """Run the workload on ``model`` and take both screenshots into ``out``; returns what was done."""
    if model.startswith("tiny-"):
        model_dir(model)  # built under the bench home before the server looks for it
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="kvmem-ui-") as tmp:
        server = KvmemServer(Path(tmp) / "srv", model=model, extra=["--api-key", KEY, "--prewarm-mb", "0"])
        with server:
            client = Client(server.url)
            for agent, words in AGENTS.items():
                client.turn(agent, _prompt(rng, words))
            log("restart: every cache is on disk now (warm)")
            server.restart()
            client = Client(server.url)
            for agent in ("planner", "support-bot-7"):
                client.turn(agent, _prompt(rng, AGENTS[agent]) + " Continue.")
            run = client.http.post("/v1/scenarios", json={"name": "gossip", "max_tokens": 4}).json()
            _until(lambda: client.http.get(f"/v1/scenarios/{run['id']}").json()["status"] != "running", 600)
            stop = threading.Event()
            counted: list[int] = []
            worker = threading.Thread(target=lambda: counted.append(_activity(client, activity_s, stop)), daemon=True)
            worker.start()
            with open_chromium(width=1280, height=900) as driver:
                driver.get(f"{server.url}/ui#key={KEY}")
                _until(lambda: driver.execute_script("return !document.getElementById('app').hidden"), 30)
                _chat_through_the_page(driver)
                worker.join()
                from selenium.webdriver.common.by import By

                _until(lambda: driver.find_elements(By.CSS_SELECTOR, f'li[data-run="{run["id"]}"] button'), 30)
                driver.find_element(By.CSS_SELECTOR, f'li[data-run="{run["id"]}"] button').click()
                _until(lambda: driver.execute_script("return !document.getElementById('scenario-back').hidden"), 30)
                time.sleep(5)  # a full round of polls after the last turn
                full_page_png(driver, out / "ui_wide.png", width=1280)
                full_page_png(driver, out / "ui_narrow.png", width=420)
                agents = driver.execute_script("return document.querySelectorAll('#agents-body tr').length")
            stop.set()
    return {"agents": agents, "activity_turns": sum(counted), "scenario_run": run["id"]}


def main(argv: list[str] | None = None) -> None:
    """``python -m benches ui_screenshots [--quick]``."""
    p = argparse.ArgumentParser(prog="python -m benches ui_screenshots", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny-llama and 20 s of background turns (not 75 s)")
    p.add_argument("--model", help="the model served (default: kvmem-default; tiny-llama with --quick)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where the PNGs go (default benches/results)")
    args = p.parse_args(argv)
    why = missing()
    if why is not None:
        raise SystemExit(f"cannot take screenshots: {why}")
    model = args.model or ("tiny-llama" if args.quick else "kvmem-default")
    res = ResultFile("ui_screenshots", "The operator page (/ui) at 1280 and 420 px", False, argv or [], model=None,
                     setup=[f"`kvmem serve --model {model} --api-key ...`; Debian's headless Chromium"])
    done = shoot(args.out, model=model, activity_s=20.0 if args.quick else 75.0)
    log(f"screenshots in {args.out}: {done}")
    res.record(**done)
    res.body += [
        "What the page showed: agents of several sizes (some warm after a restart, some hot), the `gossip`",
        "scenario's run with its phases and report, a chat through the page (its second turn hot), and",
        f"{done['activity_turns']} turns in the background for the chart.", "",
        "## 1280 px", "", "![the operator page, 1280 px wide](ui_wide.png)", "",
        "## 420 px", "", "![the operator page, 420 px wide](ui_narrow.png)", "",
    ]
    res.write()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A screenshot of the server's web page on the real default model, for the docs (not a test).

    python launch/docgen/page_shot.py [--out results/page/qwen-2-ranks-chat.png]

Starts `mpiexec -n 2 pipeinfer serve -t 1` (the default model and draft; launch/bench/serve_load.py's start_server, on a
free loopback port), opens its page in a headless Chromium (harness.headless_chromium), asks the page's chat the
README's question, waits for the whole answer, saves the screenshot and stops the server.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, free_port, headless_chromium, new_tag, on_path  # noqa: E402

on_path("bench", pythonpath=True)  # this tree's pipeinfer, here and in the server; bench/serve_load.py
from serve_load import start_server, stop_server  # noqa: E402

QUESTION = "Write a Python function that checks whether a number is prime."


def wait_for(check, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    sys.exit(f"page_shot: {what} did not happen in {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "page" / "qwen-2-ranks-chat.png"))
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    from selenium.webdriver.common.by import By

    port = free_port()
    log = Path(tempfile.gettempdir()) / "page_shot.server.log"
    server = start_server(port, ["-t", "1"], log, new_tag())
    browser = None
    try:
        browser = headless_chromium("--window-size=1500,1050")
        browser.get(f"http://127.0.0.1:{port}/")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".rank[data-rank]"), 60, "the ranks on the page")
        box = browser.find_element(By.ID, "chat-max")
        box.clear()
        box.send_keys(str(args.max_tokens))
        browser.execute_script("arguments[0].value = arguments[1]", browser.find_element(By.ID, "chat-input"), QUESTION)
        browser.find_element(By.ID, "chat-send").click()
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"), 300, "the answer")
        time.sleep(1.5)  # the next poll of /state shows the request and the stages' shares
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        browser.get_screenshot_as_file(args.out)
        print(f"wrote {args.out}")
    finally:
        if browser is not None:
            browser.quit()
        stop_server(server)


if __name__ == "__main__":
    main()

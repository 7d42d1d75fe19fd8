#!/usr/bin/env python3
"""A screenshot of the server's web page on the real default model, for the docs (not a test).

    python launch/page_shot.py [--out results/page/qwen-2-ranks-chat.png]

Starts `mpiexec -n 2 pipeinfer serve -t 1` (the default model and draft) on a free loopback port, opens its page in a
headless Chromium (selenium, Debian's chromium and chromium-driver, as tests/test_page.py), asks the page's chat the
README's question, waits for the whole answer and for the ranks' busy shares to show, saves the screenshot and
stops the server.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Write a Python function that checks whether a number is prime."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    sys.exit(f"page_shot: {what} did not happen in {timeout:.0f} s")


def healthy(port: int) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "page" / "qwen-2-ranks-chat.png"))
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    port = free_port()
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    server = subprocess.Popen([mpiexec, "-n", "2", sys.executable, "-m", "pipeinfer", "serve", "-t", "1",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    browser = None
    try:
        wait_for(lambda: healthy(port) or server.poll() is not None, 300, "the server's start")
        if server.poll() is not None:
            sys.exit(f"page_shot: the server ended with exit code {server.returncode}")
        opts = webdriver.ChromeOptions()
        opts.binary_location = shutil.which("chromium")
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--window-size=1500,1050", "--no-first-run"):
            opts.add_argument(arg)
        browser = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
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
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()

"""Regenerate the README's screenshots of the built-in page (docs/img/*.png).

Drives Debian's chromium with Selenium. The playground chats with stories260K
(../shared/models/stories260K, a real tiny Llama that writes stories; a one-line chat template
joins the messages, since it has none). The dashboard watches the built-in default model (the
135M shape, dummy weights: its steps take as long as the real model's) while the page's
built-in load runs, a 2,048-token prompt among short ones.

    python docs/screenshots.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from test_web_ui import browser, wait_for  # noqa: E402  (the tests' browser set-up)

from fulcrum.async_engine import AsyncLLM  # noqa: E402
from fulcrum.server import BackgroundServer, build_app  # noqa: E402

MODEL = HERE.parent.parent / "shared" / "models" / "stories260K"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def playground(driver) -> None:
    from selenium.webdriver.common.by import By

    llm = AsyncLLM.from_engine_args(model=str(MODEL))
    try:
        with BackgroundServer(build_app(llm, "stories260K", chat_template=TEMPLATE)) as server:
            driver.get(server.url + "/")
            driver.execute_script("localStorage.clear()")
            driver.get(server.url + "/")
            driver.find_element(By.ID, "system-prompt").send_keys("Once upon a time")
            driver.find_element(By.ID, "chat-input").send_keys("there was a little cat who")
            driver.find_element(By.ID, "send").click()
            wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".reply-stats"))
            driver.save_screenshot(str(HERE / "img" / "playground.png"))
    finally:
        llm.shutdown()


def dashboard(driver) -> None:
    from selenium.webdriver.common.by import By

    llm = AsyncLLM.from_engine_args()
    try:
        with BackgroundServer(build_app(llm, "fulcrum-default-135m")) as server:
            driver.get(server.url + "/")
            driver.find_element(By.ID, "tab-dashboard").click()
            time.sleep(3)
            driver.find_element(By.ID, "fire-load").click()
            time.sleep(5)  # mid-load: the long prompt's chunks beside the short requests
            driver.save_screenshot(str(HERE / "img" / "dashboard.png"))
    finally:
        llm.shutdown()


def main() -> None:
    driver = browser()
    try:
        playground(driver)
        dashboard(driver)
    finally:
        driver.quit()
    print("wrote", HERE / "img" / "playground.png", "and", HERE / "img" / "dashboard.png")


if __name__ == "__main__":
    main()

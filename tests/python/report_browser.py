"""Opens a tracer report in headless Chromium (Debian's chromium + chromium-driver, through
selenium) and prints what the browser saw as JSON: console messages, every network request,
the embedded data, the visible figures, and where the screenshot went.

usage: report_browser.py REPORT.html SCREENSHOT.png PROFILE_DIR
"""
import json
import pathlib
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

report, screenshot, profile = sys.argv[1], sys.argv[2], sys.argv[3]
options = webdriver.ChromeOptions()
options.binary_location = "/usr/bin/chromium"
for arg in [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--window-size=1280,2400",
    "--user-data-dir=" + profile,
]:
    options.add_argument(arg)
options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
try:
    url = pathlib.Path(report).resolve().as_uri()
    # The browser's own start-up pages are not the report's: forget what they fetched.
    driver.get_log("performance")
    started = time.monotonic()
    driver.get(url)
    ready = None
    while time.monotonic() - started < 60:
        ready = driver.execute_script("return window.__tracerReportReady")
        if ready is not None:
            break
        time.sleep(0.1)
    load_seconds = time.monotonic() - started
    driver.save_screenshot(screenshot)
    console = [
        {"level": e["level"], "message": e["message"]} for e in driver.get_log("browser")
    ]
    requests = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        # What the report's document asked for (the browser's own pages load beside it).
        if msg["method"] == "Network.requestWillBeSent" and msg["params"].get("documentURL") == url:
            requests.append(msg["params"]["request"]["url"])
    cells = lambda sel: [e.text for e in driver.find_elements(By.CSS_SELECTOR, sel)]
    ops = {}
    for table in driver.find_elements(By.CSS_SELECTOR, "#processes table.ops"):
        pid = table.get_attribute("data-pid")
        rows = []
        for tr in table.find_elements(By.CSS_SELECTOR, "tr")[1:]:
            rows.append([td.text for td in tr.find_elements(By.CSS_SELECTOR, "td")])
        ops[pid] = rows
    losses = {}
    for tr in driver.find_elements(By.CSS_SELECTOR, "#losses table tr")[1:]:
        k, v = [td.text for td in tr.find_elements(By.CSS_SELECTOR, "td")]
        losses[k] = v
    out = {
        "ready": ready,
        "load_seconds": load_seconds,
        "console": console,
        "requests": requests,
        "url": url,
        "data": json.loads(driver.execute_script("return document.getElementById('data').textContent")),
        "summary": driver.find_element(By.ID, "summary").text,
        "chain_titles": cells("#chains .chain h3"),
        "ops": ops,
        "losses": losses,
        "segments": len(driver.find_elements(By.CSS_SELECTOR, "#segmap .seg")),
        "export_commands": cells("#segmap .export code"),
        "segmap_notes": cells("#segmap p.note"),
        "segment_labels": cells("#segmap .seg .label"),
        "whatif_rows": [[td.text for td in tr.find_elements(By.CSS_SELECTOR, "td")]
                        for tr in driver.find_elements(By.CSS_SELECTOR, "#whatif table tr")[1:]],
        "runs": len(driver.find_elements(By.CSS_SELECTOR, "#segmap .run")),
        "holders": [[[td.text for td in tr.find_elements(By.CSS_SELECTOR, "td")]
                     for tr in table.find_elements(By.CSS_SELECTOR, "tr")[1:]]
                    for table in driver.find_elements(By.CSS_SELECTOR, "#holders table")],
        "holders_said": cells("#holders p"),
        "snapshot_label": driver.execute_script(
            "const s = document.getElementById('snapshot'); return s.options[s.selectedIndex].text"
        ),
        "canvases": len(driver.find_elements(By.CSS_SELECTOR, "#charts canvas")),
        "licence": driver.find_element(By.ID, "licence").text,
        "screenshot": screenshot,
    }
    print(json.dumps(out))
finally:
    driver.quit()

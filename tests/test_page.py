"""The search page at `/`, driven in a real headless Chromium (Debian's `chromium` and
`chromium-driver`, which scripts/install.sh installs where it may): type a query, press Enter, see k
results with the answer's latency bar; with a key set, a search without it shows the 401 message; over an
index with a candidate structure, the page says how each answer was found and can ask the exact scan."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from retrieval.searcher import Searcher
from service.engine.search_engine import SearchEngine
from tests.conftest import CPU
from tests.test_admission import serving
from tests.test_candidates_served import hnsw_engine, hnsw_index  # noqa: F401 - the small index with a HNSW graph
from tests.test_filters import fields_corpus, fields_index  # noqa: F401 - the small index with metadata fields
from tests.test_rerank_service import small_cross_encoder  # noqa: F401 - the session fixture

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
KEY = "page-test-key"
# Where the screenshot of a page with results goes (docs/search-page.png is one of these).
SCREENSHOT = os.environ.get("SEARCH_PAGE_SCREENSHOT")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium and chromium-driver are not installed (scripts/install.sh installs them as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,900"):
        options.add_argument(argument)
    # The driver is named explicitly, so Selenium Manager never tries to download one.
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    yield driver
    driver.quit()


def wait(browser, condition, seconds: float = 30):
    return WebDriverWait(browser, seconds).until(lambda driver: condition(driver))


def search_from_the_keyboard(browser, query: str, k: int) -> None:
    wait(browser, lambda d: "loading" not in d.find_element(By.ID, "index").text)  # /ready has answered
    k_box = browser.find_element(By.ID, "k")
    k_box.clear()
    k_box.send_keys(str(k))
    box = browser.find_element(By.ID, "query")
    box.clear()
    box.send_keys(query, Keys.ENTER)


def test_a_query_typed_and_entered_shows_k_results_and_the_latency_bar(browser, small_index, engine, demo_queries,
                                                                       tmp_path):
    query = demo_queries["q0001"]
    with serving(small_index, engine) as (app, base, port):
        browser.get(f"{base}/")
        assert "passages" in wait(browser, lambda d: d.find_element(By.ID, "index").text)
        assert not browser.find_element(By.ID, "key").is_displayed()  # no key, no key field
        assert not browser.find_element(By.ID, "rerank").is_displayed()  # no reranker configured
        assert not browser.find_element(By.ID, "exact").is_displayed()  # no candidate structure
        assert not browser.find_element(By.ID, "filter").is_displayed()  # no metadata fields
        search_from_the_keyboard(browser, query, 5)
        items = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#results li") or None)
        assert len(items) == 5
        expected = [hit.id for hit in engine.searcher.search(query, 5)]  # the default retrieval: hybrid z-score
        assert [item.find_element(By.CLASS_NAME, "hit-id").text for item in items] == expected
        assert " · hybrid · " in browser.find_element(By.ID, "summary").text  # the mode that ran
        assert [item.find_element(By.CLASS_NAME, "hit-rank").text for item in items] == [f"#{r}" for r in range(1, 6)]
        assert all(item.find_element(By.CLASS_NAME, "hit-text").text for item in items)
        bar = browser.find_element(By.ID, "latency")
        stages = {part.get_attribute("class") for part in bar.find_elements(By.TAG_NAME, "span")}
        assert {"stage-encode", "stage-retrieve"} <= stages
        assert all(part.size["width"] > 0 for part in bar.find_elements(By.TAG_NAME, "span"))
        assert "encode" in bar.get_attribute("aria-label") and "total" in bar.get_attribute("aria-label")
        browser.save_screenshot(str(Path(SCREENSHOT) if SCREENSHOT else tmp_path / "search-page.png"))
        assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None
        assert not browser.find_element(By.ID, "searched").is_displayed()  # nothing could be answered otherwise


def test_an_answer_through_a_structure_shows_its_recall_card_and_exact_asks_the_full_scan(
        browser, hnsw_index, hnsw_engine, engine, demo_queries):  # noqa: F811
    query = demo_queries["q0005"]
    card, = hnsw_engine.candidate_cards()
    with serving(hnsw_index, hnsw_engine) as (app, base, port):
        browser.get(f"{base}/")
        wait(browser, lambda d: d.find_element(By.ID, "exact").is_displayed())
        search_from_the_keyboard(browser, query, 5)
        searched = wait(browser, lambda d: d.find_element(By.ID, "searched").text or None)
        assert searched == (f"approximate: hnsw, recall@10 {card['recall_at_10']:.3f} measured on "
                            f"{card['sample']} held-out passages")  # 300: the small index holds no more
        expected = [hit.id for hit in engine.search(query, 5).hits]  # the exact scan's, with no structure
        ids = [item.text for item in browser.find_elements(By.CSS_SELECTOR, "#results .hit-id")]
        assert ids == expected
        browser.find_element(By.ID, "exact").send_keys(Keys.SPACE)  # the keyboard ticks it
        browser.find_element(By.ID, "query").send_keys(Keys.ENTER)
        assert wait(browser, lambda d: d.find_element(By.ID, "searched").text == "exact" or None)
        assert [item.text for item in browser.find_elements(By.CSS_SELECTOR, "#results .hit-id")] == expected


def test_rerank_on_asks_the_chosen_reranker_and_the_bar_shows_its_stage(browser, small_index, searcher, demo_queries,
                                                                      small_cross_encoder):  # noqa: F811
    query = demo_queries["q0004"]
    engine = SearchEngine(searcher, {"monobert": small_cross_encoder})
    with serving(small_index, engine, rerankers=[small_cross_encoder.path], rerank_depth=20) as (app, base, port):
        browser.get(f"{base}/")
        wait(browser, lambda d: d.find_element(By.ID, "rerank").is_displayed())
        assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#reranker option")] == ["monobert"]
        browser.find_element(By.ID, "rerank").send_keys(Keys.SPACE)  # the keyboard ticks it
        search_from_the_keyboard(browser, query, 4)
        items = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#results li") or None)
        expected = engine.search(query, 4, rerank_depth=20)
        assert [item.find_element(By.CLASS_NAME, "hit-id").text for item in items] == [h.id for h in expected.hits]
        assert all("probability" in item.find_element(By.CLASS_NAME, "hit-score").text for item in items)
        assert browser.find_elements(By.CSS_SELECTOR, "#latency .stage-rerank")


def test_a_filter_narrows_the_results_and_a_bad_one_shows_the_422_naming_the_field(
        browser, fields_index, encoder, demo_queries):  # noqa: F811
    query = demo_queries["q0006"]
    engine = SearchEngine(Searcher(fields_index, encoder, load=CPU))
    with serving(fields_index, engine) as (app, base, port):
        browser.get(f"{base}/")
        box = wait(browser, lambda d: d.find_element(By.ID, "filter") if d.find_element(By.ID, "filter").is_displayed()
                   else None)
        assert "source (string)" in browser.find_element(By.ID, "filter-note").text
        box.send_keys('{"source": "wiki", "year": {"$gte": 2000}}')
        search_from_the_keyboard(browser, query, 5)
        items = wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#answer:not([hidden]) #results li") or None)
        expected = engine.search(query, 5, filter={"source": "wiki", "year": {"$gte": 2000}}).hits
        assert [item.find_element(By.CLASS_NAME, "hit-id").text for item in items] == [hit.id for hit in expected]
        assert all("source: wiki" in item.find_element(By.CLASS_NAME, "hit-fields").text for item in items)
        box.clear()
        box.send_keys('{"sourc": "wiki"}', Keys.ENTER)  # Enter in the filter box searches too
        error = wait(browser, lambda d: d.find_element(By.ID, "error").text or None)
        assert error.startswith("422") and 'unknown field "sourc"' in error
        assert browser.find_element(By.ID, "answer").get_attribute("hidden") is not None
        box.clear()
        box.send_keys('{"source": wiki}', Keys.ENTER)
        assert wait(browser, lambda d: d.find_element(By.ID, "error").text.startswith("filter: not valid JSON") or None)


def test_on_a_narrow_window_nothing_scrolls_sideways(browser, small_index, engine, demo_queries):
    with serving(small_index, engine) as (app, base, port):
        browser.set_window_size(380, 800)
        try:
            browser.get(f"{base}/")
            search_from_the_keyboard(browser, demo_queries["q0002"], 3)
            assert len(wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#results li") or None)) == 3
            assert browser.execute_script(
                "return document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        finally:
            browser.set_window_size(1100, 900)


def test_with_a_key_the_page_shows_the_401_until_the_key_is_given(browser, small_index, engine, demo_queries):
    with serving(small_index, engine, api_key=KEY) as (app, base, port):
        browser.get(f"{base}/")
        browser.execute_script("sessionStorage.clear()")
        browser.get(f"{base}/")
        assert browser.find_element(By.ID, "key").is_displayed()
        search_from_the_keyboard(browser, demo_queries["q0003"], 3)
        error = wait(browser, lambda d: d.find_element(By.ID, "error").text or None)
        assert error.startswith("401") and "API key" in error
        assert not browser.find_elements(By.CSS_SELECTOR, "#answer:not([hidden]) #results li")
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.ID, "query").send_keys(Keys.ENTER)
        assert len(wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#answer:not([hidden]) #results li")
                        or None)) == 3
        assert browser.execute_script("return sessionStorage.getItem('dense-search-api-key')") == KEY
        # /ready tells the index's details only to the key's holder: the page shows them once it has the key.
        wait(browser, lambda d: "passages" in d.find_element(By.ID, "index").text)
        assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None

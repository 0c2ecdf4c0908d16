"""The console in a real headless Chromium, over a real persisted index and the bundled generator.

One ingest, one engine, one server and one browser for the module. What the page shows is checked
against the JSON the server answered for the same query (``GET /queries/{id}``).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from llama_index_crag import CorrectiveQueryEngine
from llama_index_crag.core.persisted import load_engine
from llama_index_crag.datasets import SAMPLE_DIR
from llama_index_crag.server.app import create_app
from llama_index_crag.server.keys import parse_api_keys
from llama_index_crag.server.service import Generator, ServerConfig
from llama_index_crag.stores.folder import ingest, load_index
from tests.conftest import Answering
from tests.live_server import LiveServer

pytestmark = pytest.mark.slow

#: Questions of the sample set and the band each lands in with the default settings.
CORRECT = "What is the monthly uptime SLA for Harbor Pro?"
AMBIGUOUS = "What does Harbor's engineering site in the largest city do?"
INCORRECT = "Who wrote the novel Moby-Dick?"
#: Two questions joined: the rules split it, each part answered on its own.
COMPOUND = "Who is the CEO of Harbor Analytics, and what is the monthly uptime SLA for Harbor Pro?"
#: A document of markup that must come back to the page as text, and a question that retrieves it.
MARKUP_DOC_ID = "quillfeather-test-page"
MARKUP_TEXT = (
    "The Quillfeather parser test page checks that markup is shown as text. The test page holds the snippet "
    '<script>window.__pwned=1</script> and the image tag <img src=x onerror="window.__pwned=2"> as plain words. '
    "The Quillfeather parser test page was written in 2021 by the documentation team."
)
MARKUP_QUERY = (
    "What snippet does the Quillfeather parser test page hold? "
    # No figure of its own: a quoted answer must hold every figure the question names, and this one asks
    # about the page's snippet, not about these numbers.
    '<script>window.__pwned="query"</script><img src=x onerror="window.__pwned=\'image\'">'
)
#: What ``llama-crag serve --llm auto`` says of its generator without Ollama, and the label its header shows.
GENERATOR = Generator(
    "no Ollama model qwen2.5:3b at http://127.0.0.1:11434; using in-process llama.cpp with the bundled model.gguf",
    label="llama.cpp model.gguf",
)
#: Seconds to wait for one answer: the bundled model on two slow cores, with a rewrite on the INCORRECT path.
ANSWER_WAIT_S = 240
#: Where to write the documentation's screenshots (unset: none are written).
SCREENSHOTS = os.environ.get("CRAG_CONSOLE_SCREENSHOTS")


def _required(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not on PATH: the console tests drive a real headless Chromium "
            "(Debian: apt-get install chromium chromium-driver)",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The sample corpus plus one document of markup, ingested once, with the bundled generator."""
    from llama_index_crag.local.llamacpp import BundledLlamaCPP

    docs = tmp_path_factory.mktemp("docs")
    rows = (SAMPLE_DIR / "corpus.jsonl").read_text().splitlines()
    rows.append(json.dumps({"doc_id": MARKUP_DOC_ID, "title": "Quillfeather <b>test page</b>", "text": MARKUP_TEXT}))
    (docs / "corpus.jsonl").write_text("\n".join(rows) + "\n")
    index_dir = tmp_path_factory.mktemp("index")
    ingest(docs, index_dir)
    return load_engine(load_index(index_dir), BundledLlamaCPP())


@pytest.fixture(scope="module")
def server(engine: Any) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, generator=GENERATOR)) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = _required("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=_required("chromedriver")))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def open_console(driver: WebDriver, url: str) -> None:
    driver.get(url + "/")
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete" and d.find_elements(By.ID, "query-form"),
        message=f"the console did not load from {url}/",
    )


def ask(driver: WebDriver, question: str, explain: bool = False, stream: bool = True) -> str:
    """Submit ``question`` through the form, wait for the page to draw the answer, return the query id."""
    box = driver.find_element(By.ID, "query-input")
    box.clear()
    box.send_keys(question)
    for box_id, wanted in (("explain", explain), ("stream", stream)):
        checkbox = driver.find_element(By.ID, box_id)
        if checkbox.is_selected() != wanted:
            checkbox.click()
    before = driver.find_element(By.ID, "result").get_attribute("data-query-id")
    driver.find_element(By.ID, "ask").click()
    return wait_for_answer(driver, before)


def state(driver: WebDriver) -> str:
    """What the page is doing: idle, busy, done, error, or auth (waiting for the API key)."""
    return str(driver.find_element(By.TAG_NAME, "body").get_attribute("data-state"))


def wait_for_answer(driver: WebDriver, before: Optional[str] = None) -> str:
    def drawn(d: WebDriver) -> bool:
        current = d.find_element(By.ID, "result").get_attribute("data-query-id")
        return state(d) == "error" or (state(d) == "done" and bool(current) and current != before)

    WebDriverWait(driver, ANSWER_WAIT_S).until(drawn, message=f"no answer drawn after {ANSWER_WAIT_S} s")
    error = driver.find_element(By.ID, "error")
    assert not error.is_displayed(), f"the console shows an error: {error.text}"
    return str(driver.find_element(By.ID, "result").get_attribute("data-query-id"))


def stored(server: LiveServer, query_id: str, key: Optional[str] = None) -> Dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.get(f"{server.url}/queries/{query_id}", headers=headers, timeout=10)
    response.raise_for_status()
    return dict(response.json())


def shown_answer(result: Dict[str, Any]) -> str:
    """The answer as the page draws it: a quoted one without the engine's opening line (the answer mode says it)."""
    answer = str(result["answer"])
    if result.get("answered_by") != "extract":
        return answer
    return re.sub(r"^Quoted from the documents \(not generated\):[ \t]*(\r?\n)?", "", answer)


def by_testid(root: Any, name: str) -> List[WebElement]:
    return list(root.find_elements(By.CSS_SELECTOR, f'[data-testid="{name}"]'))


def text(driver: WebDriver, element: WebElement) -> str:
    """The element's text exactly as the page holds it (``.text`` would normalise white space)."""
    return str(driver.execute_script("return arguments[0].textContent;", element))


def place(driver: WebDriver, element: WebElement, prop: str) -> float:
    """A bar's or mark's inline ``width`` or ``left``, as a fraction of the bar."""
    value = str(driver.execute_script(f"return arguments[0].style.{prop};", element))
    assert value.endswith("%"), f"{prop} is {value!r}, not a percentage"
    return float(value[:-1]) / 100


def assert_trace_drawn(driver: WebDriver, result: Dict[str, Any]) -> None:
    """The action, each candidate as a bar with both threshold marks, and one row per stage timing."""
    crag = result["crag"]
    action = driver.find_element(By.ID, "action")
    assert action.text.lower() == crag["action"] and action.is_displayed()
    rows = by_testid(driver, "candidate")
    assert len(rows) == len(crag["nodes"]) > 0
    for row, node in zip(rows, crag["nodes"]):
        origin = "primary" if node["source"] == "retriever" else node["source"]
        assert row.get_attribute("data-node-id") == node["node_id"]
        assert by_testid(row, "candidate-label")[0].text == node["label"]
        assert by_testid(row, "candidate-origin")[0].text == origin
        assert float(by_testid(row, "candidate-score")[0].text) == pytest.approx(node["score"], abs=1e-6)
        fill = row.find_element(By.CSS_SELECTOR, '[data-testid="score-bar"] .fill')
        assert place(driver, fill, "width") == pytest.approx(node["score"], abs=1e-3)
        for which in ("lower", "upper"):
            mark = by_testid(row, f"threshold-{which}")[0]
            assert place(driver, mark, "left") == pytest.approx(crag["thresholds"][which], abs=1e-3)
            assert mark.is_displayed()
        assert not by_testid(row, "explanation"), "explanations are drawn only when asked for"
    stages = [r.get_attribute("data-stage") for r in by_testid(driver, "timing")]
    assert stages == [s for s in crag["timings_ms"] if s != "crag_ms"] + ["crag_ms"]


def screenshot(driver: WebDriver, name: str) -> None:
    """Write the whole page as ``name`` into ``CRAG_CONSOLE_SCREENSHOTS``, when that is set."""
    if not SCREENSHOTS:
        return
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {"captureBeyondViewport": True, "clip": {"x": 0, "y": 0, "width": 1280, "height": height, "scale": 1}},
    )
    png = base64.b64decode(shot["data"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1280, height)
    folder = Path(SCREENSHOTS)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_bytes(png)


def test_a_correct_answer_is_drawn_with_its_graded_candidates(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    result = stored(server, ask(browser, CORRECT))
    assert result["action"] == "correct" and not result["abstained"]
    assert text(browser, browser.find_element(By.ID, "answer")) == shown_answer(result) != ""
    assert not browser.find_element(By.ID, "abstention").is_displayed()
    assert_trace_drawn(browser, result)
    assert {r.get_attribute("data-label") for r in by_testid(browser, "candidate")} >= {"correct"}
    assert not browser.find_element(By.ID, "refinement").is_displayed()
    assert not browser.find_element(By.ID, "correction").is_displayed()
    sources = by_testid(browser, "source")
    assert [s.get_attribute("data-origin") for s in sources] == [s["origin"] for s in result["sources"]]
    assert all(s.find_element(By.TAG_NAME, "blockquote").text for s in sources)


def test_an_ambiguous_answer_strikes_through_the_dropped_strips(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    result = stored(server, ask(browser, AMBIGUOUS))
    assert result["action"] == "ambiguous" and not result["abstained"]
    assert text(browser, browser.find_element(By.ID, "answer")) == shown_answer(result) != ""
    assert_trace_drawn(browser, result)
    strips = by_testid(browser, "strip")
    assert [s.get_attribute("data-kept") for s in strips] == [str(s["kept"]).lower() for s in result["crag"]["strips"]]
    assert {"true", "false"} <= {s.get_attribute("data-kept") for s in strips}, "expected kept and dropped strips"
    for row, strip in zip(strips, result["crag"]["strips"]):
        struck = row.find_elements(By.TAG_NAME, "del")
        if strip["kept"]:
            assert not struck
        else:
            assert text(browser, struck[0]) == strip["text"]
            assert "line-through" in struck[0].value_of_css_property("text-decoration-line")
    assert any(s["refined"] for s in result["sources"])
    screenshot(browser, "console-answered.png")


def test_an_incorrect_query_shows_the_abstention_rewrite_and_fallback(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    result = stored(server, ask(browser, INCORRECT))
    crag = result["crag"]
    assert result["action"] == "incorrect" and result["abstained"]
    banner = browser.find_element(By.ID, "abstention")
    assert banner.is_displayed() and "Abstained: the documents do not answer this" in banner.text
    assert text(browser, browser.find_element(By.ID, "abstain-reason")) == crag["abstain_reason"]
    assert text(browser, browser.find_element(By.ID, "answer")) == ""
    assert_trace_drawn(browser, result)
    assert crag["rewritten_query"] and crag["fallback_sources"]
    assert text(browser, browser.find_element(By.ID, "rewritten-query")) == crag["rewritten_query"]
    assert [e.text for e in by_testid(browser, "fallback-source")] == crag["fallback_sources"]
    origins = {r.get_attribute("data-origin") for r in by_testid(browser, "candidate")}
    assert "primary" in origins and origins & set(crag["fallback_sources"])
    assert not by_testid(browser, "source") and browser.find_element(By.ID, "sources-empty").is_displayed()
    screenshot(browser, "console-abstained.png")


def test_the_recent_list_grows_and_a_click_redraws_a_past_query(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    before = len(by_testid(browser, "recent-item"))
    first = ask(browser, CORRECT)
    second = ask(browser, INCORRECT)
    items = by_testid(browser, "recent-item")
    assert len(items) == before + 2
    assert [(i.get_attribute("data-id"), i.get_attribute("data-action")) for i in items[:2]] == [
        (second, "incorrect"),
        (first, "correct"),
    ]
    assert items[1].find_element(By.CLASS_NAME, "recent-query").text == CORRECT
    items[1].click()
    wait_for_answer(browser, second)
    result = stored(server, first)
    assert browser.find_element(By.ID, "result").get_attribute("data-query-id") == first
    assert text(browser, browser.find_element(By.ID, "result-query")) == CORRECT
    assert text(browser, browser.find_element(By.ID, "answer")) == shown_answer(result)
    assert not browser.find_element(By.ID, "abstention").is_displayed()
    assert_trace_drawn(browser, result)
    assert by_testid(browser, "recent-item")[1].get_attribute("aria-current") == "true"


def test_markup_in_documents_and_queries_is_shown_as_text(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    result = stored(server, ask(browser, MARKUP_QUERY))
    assert any(s["doc_id"] == MARKUP_DOC_ID for s in result["sources"]), "the markup document was not retrieved"
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    for region in ("result", "recent"):
        container = browser.find_element(By.ID, region)
        assert not container.find_elements(By.CSS_SELECTOR, "img, script"), f"markup was parsed in #{region}"
    page = browser.find_element(By.TAG_NAME, "body").text
    assert "<script>window.__pwned=1</script>" in page, "the document's markup is not shown as text"
    assert "<img src=x onerror=\"window.__pwned='image'\">" in page, "the query's markup is not shown as text"


def test_explain_draws_each_candidates_explanation(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    result = stored(server, ask(browser, CORRECT, explain=True, stream=False))
    rows = by_testid(browser, "candidate")
    assert len(rows) == len(result["crag"]["nodes"]) > 0
    for row, node in zip(rows, result["crag"]["nodes"]):
        explanation = node["explanation"]
        assert explanation, "the scorer gave no explanation"
        drawn = by_testid(row, "explanation")[0]
        terms = [t.text for t in drawn.find_elements(By.CSS_SELECTOR, "dl > dt")]
        assert set(explanation) <= set(terms)
        assert set(explanation["contributions"]) <= set(terms)
        missing = ", ".join(explanation["missing_terms"]) or "(none)"
        assert missing in drawn.text


def test_a_quoted_answer_says_it_was_not_generated(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    result = stored(server, ask(browser, CORRECT))
    assert result["answered_by"] == "extract" and result["crag"]["answer_mode"] == "extract"
    assert "Quoted from the documents, not generated" in browser.find_element(By.ID, "answer-mode").text
    # The engine's answer opens with the same words; the panel says them once, above the quotes.
    assert result["answer"].startswith("Quoted from the documents (not generated):")
    panel = browser.find_element(By.ID, "result-heading").find_element(By.XPATH, "..")
    assert text(browser, panel).count("Quoted from the documents") == 1, panel.text
    assert text(browser, browser.find_element(By.ID, "answer")) == shown_answer(result) != result["answer"]


def test_the_header_names_the_generator_in_a_few_words(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    info = browser.find_element(By.ID, "server-info")
    WebDriverWait(browser, 10).until(lambda _: "generator" in info.text)
    assert "generator llama.cpp model.gguf" in info.text and "no Ollama model" not in info.text, info.text
    assert info.get_attribute("title") == "Generator: " + GENERATOR.name  # the whole sentence on hover
    assert not by_testid(browser, "unsupported") and not browser.find_element(By.ID, "evidence").is_displayed()


#: A generated answer with figures and a name that no passage holds.
WRONG_ANSWER = "Harbor Pro promises 97.5% monthly uptime, set by Quentin Marsh."


def flagging(engine: Any, **settings: Any) -> CorrectiveQueryEngine:
    """The console's engine, but generating ``WRONG_ANSWER`` and keeping it flagged when its check fails."""
    return CorrectiveQueryEngine.from_defaults(
        retriever=engine.retriever.retriever,
        llm=Answering(answer=WRONG_ANSWER),
        scorer=engine.grader.scorer,
        fallback=engine.fallback,
        upper=engine.grader.upper,
        lower=engine.grader.lower,
        answer_mode="generate",
        on_ungrounded="flag",
        **settings,
    )


def test_a_generated_answer_the_sources_do_not_support_is_marked(browser: WebDriver, engine: Any) -> None:
    with LiveServer(create_app(flagging(engine))) as live:
        open_console(browser, live.url)
        result = stored(live, ask(browser, CORRECT))
        check = result["crag"]["answer_check"]
        assert result["answered_by"] == "generate" and result["grounded"] is False and check["streamed"]
        mode = browser.find_element(By.ID, "answer-mode")
        assert "NOT supported by its sources" in mode.text and mode.get_attribute("data-grounded") == "false"
        marked = [text(browser, m) for m in by_testid(browser, "unsupported")]
        assert {"97.5%", "Quentin Marsh"} <= set(marked) and set(marked) <= set(check["unsupported"])
        assert text(browser, browser.find_element(By.ID, "answer")) == result["answer"]
        assert result["answer"].strip() == WRONG_ANSWER
        quotes = by_testid(browser, "quote")
        assert quotes and len(quotes) == len(result["crag"]["quotes"]) and any("99.9%" in q.text for q in quotes)
        screenshot(browser, "console-flagged.png")


def test_quotes_withheld_beside_a_flagged_answer_are_shown_as_weak_evidence(browser: WebDriver, engine: Any) -> None:
    # No strip reaches a quote threshold of 1: the best is withheld.
    with LiveServer(create_app(flagging(engine, quote_threshold=1.0))) as live:
        open_console(browser, live.url)
        result = stored(live, ask(browser, CORRECT))
        check = result["crag"]["quote_check"]
        assert result["answered_by"] == "generate" and result["crag"]["quotes"] == [] and check["passed"] is False
        assert browser.find_element(By.ID, "evidence").get_attribute("data-weak") == "true"
        label = text(browser, browser.find_element(By.ID, "evidence-label"))
        assert "weakly" in label and f"{check['grade']:.3f}" in label and f"{check['threshold']:.3f}" in label
        quotes = [q.text for q in by_testid(browser, "quote")]
        assert len(quotes) == len(check["withheld"]) and all(w["text"] in q for w, q in zip(check["withheld"], quotes))


#: Two entries of a settings page: retrieval finds the neighbour, which names the asked setting.
FREEZE_MIN = (
    "#### vacuum_freeze_min_age (integer)\n\nSpecifies the cutoff age that vacuum uses to freeze rows. The default "
    "is 50 million transactions, at most half the value of autovacuum_freeze_max_age."
)
FREEZE_MAX = (
    "#### autovacuum_freeze_max_age (integer)\n\nSpecifies the maximum age a table reaches before a forced vacuum. "
    "The default is 200 million transactions."
)


def test_a_search_for_the_asked_entry_by_name_is_shown_in_the_correction(browser: WebDriver) -> None:
    from llama_index.core.schema import TextNode

    from llama_index_crag.core.fallback import FallbackRetriever
    from tests.conftest import FixedRetriever, MarkerScorer

    neighbour = TextNode(text=FREEZE_MIN, id_="freeze-min", metadata={"title": "Automatic Vacuuming"})
    own = TextNode(text=FREEZE_MAX, id_="freeze-max", metadata={"title": "Automatic Vacuuming"})
    engine = CorrectiveQueryEngine.from_defaults(
        retriever=FixedRetriever([neighbour]),
        fallback=FallbackRetriever.from_nodes([neighbour, own], sources=("bm25",), similarity_top_k=2),
        scorer=MarkerScorer({"freeze": 0.95}),
        llm=None,
        upper=0.7,
        lower=0.3,
        answer_mode="extract",
        quote_threshold=0.0,
    )
    with LiveServer(create_app(engine)) as live:
        open_console(browser, live.url)
        result = stored(live, ask(browser, "What is the default value of autovacuum_freeze_max_age?"))
        crag = result["crag"]
        assert crag["entry_search"] == "autovacuum_freeze_max_age" and not result["abstained"]
        assert browser.find_element(By.ID, "correction").is_displayed()
        shown = browser.find_element(By.ID, "entry-search")
        assert shown.is_displayed() and text(browser, shown) == crag["entry_search"]
        said = text(browser, browser.find_element(By.ID, "answer"))
        assert "200 million" in said and "50 million" not in said, said
        # A query that searched nothing by name shows no such row.
        ask(browser, "What does vacuum freeze?")
        assert not browser.find_element(By.ID, "entry-search").is_displayed()


def test_a_guarded_server_asks_for_the_key_then_answers(browser: WebDriver, engine: Any) -> None:
    with LiveServer(create_app(engine, ServerConfig(api_key="k"))) as guarded:
        open_console(browser, guarded.url)
        form = browser.find_element(By.ID, "auth-form")
        WebDriverWait(browser, 10).until(lambda _: form.is_displayed())
        assert browser.find_element(By.ID, "api-key").get_attribute("type") == "password"
        browser.find_element(By.ID, "api-key").send_keys("wrong")
        browser.find_element(By.ID, "api-key-save").click()
        WebDriverWait(browser, 10).until(lambda d: "refused" in d.find_element(By.ID, "auth-message").text)
        assert form.is_displayed()
        browser.find_element(By.ID, "query-input").send_keys(CORRECT)
        browser.find_element(By.ID, "ask").click()
        WebDriverWait(browser, 10).until(lambda d: state(d) == "auth")
        browser.find_element(By.ID, "api-key").send_keys("k")
        browser.find_element(By.ID, "api-key-save").click()
        query_id = wait_for_answer(browser)
        assert not form.is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('crag-api-key')") == "k"
        assert stored(guarded, query_id, key="k")["action"] == "correct"
        assert [i.get_attribute("data-id") for i in by_testid(browser, "recent-item")] == [query_id]


def test_a_keys_console_lists_only_that_keys_queries(browser: WebDriver, engine: Any) -> None:
    acme, globex = "k-acme-7Qv1c0mXW2pLr8sT", "k-globex-Zr4nY9bKe6uHq3"
    keys = parse_api_keys(json.dumps({acme: {"name": "acme"}, globex: {"name": "globex"}}))
    with LiveServer(create_app(engine, ServerConfig(api_keys=keys))) as live:

        def asked(key: str) -> str:
            reply = httpx.post(
                live.url + "/query", json={"query": CORRECT}, headers={"X-API-Key": key}, timeout=ANSWER_WAIT_S
            )
            reply.raise_for_status()
            return str(reply.json()["id"])

        theirs, mine = asked(globex), asked(acme)
        open_console(browser, live.url)
        browser.execute_script("sessionStorage.setItem('crag-api-key', arguments[0]);", acme)
        open_console(browser, live.url)
        WebDriverWait(browser, 10).until(lambda _: by_testid(browser, "recent-item"))
        assert [i.get_attribute("data-id") for i in by_testid(browser, "recent-item")] == [mine]
        assert theirs not in str(browser.find_element(By.ID, "recent").get_attribute("innerHTML"))


def test_a_refused_query_shows_the_servers_error(browser: WebDriver, engine: Any) -> None:
    strict_engine = engine.variant()
    strict_engine.settings = engine.settings.model_copy(update={"max_query_chars": 20})
    with LiveServer(create_app(strict_engine, ServerConfig())) as strict:
        open_console(browser, strict.url)
        browser.find_element(By.ID, "query-input").send_keys(CORRECT)
        browser.find_element(By.ID, "ask").click()
        WebDriverWait(browser, 30).until(lambda d: state(d) == "error")
        error = browser.find_element(By.ID, "error")
        assert error.is_displayed() and "query_too_long" in error.text and "over the limit of 20" in error.text
        assert browser.find_element(By.ID, "result").get_attribute("data-query-id") is None


def test_a_compound_question_lists_its_parts_and_what_found_them(browser: WebDriver, server: LiveServer) -> None:
    open_console(browser, server.url)
    result = stored(server, ask(browser, COMPOUND))
    crag = result["crag"]
    assert crag["split"]["parts"] == 2 and crag["split"]["by"] == "parser"
    summary = browser.find_element(By.ID, "summary")
    terms = [e.text for e in summary.find_elements(By.TAG_NAME, "dt")]
    values = [e.text for e in summary.find_elements(By.TAG_NAME, "dd")]
    shown = dict(zip(terms, values))
    assert shown["Question split"].startswith(f"2 parts (found in the question's wording), {crag['split']['answered']}")
    for part in crag["parts"]:
        state = "not answered" if part["abstained"] else part["action"]
        assert shown[f"Part {part['part']}"] == f"{part['question']} ({state})"
    # Each part's own candidates: a button per part draws that part's trace, the first answered part's at first.
    views = browser.find_element(By.ID, "trace-views")
    assert views.is_displayed()
    buttons = views.find_elements(By.CSS_SELECTOR, "[data-testid=trace-view]")
    assert [b.text for b in buttons] == [f"Part {p['part']}" for p in crag["parts"]]

    def drawn_candidates() -> List[str]:
        rows = browser.find_elements(By.CSS_SELECTOR, "#candidates > li")
        return [row.get_attribute("data-node-id") or "" for row in rows]

    for part, button in zip(crag["parts"], buttons):
        button.click()
        assert button.get_attribute("aria-pressed") == "true"
        assert part["question"] in browser.find_element(By.ID, "trace-view-label").text
        expected = [n["node_id"] for n in part["trace"]["nodes"]]
        assert drawn_candidates() == expected
    firsts = {p["trace"]["nodes"][0]["node_id"] for p in crag["parts"] if p["trace"]["nodes"]}
    assert len(firsts) == 2, "the two parts retrieved different passages first, so each button draws its own"

"""The policy editor in a real browser (issue 19 §4). Inside a task class, hovering a field shows that field's
description and completion offers the fields and values allowed there (hover said only the value's type, and
completion offered nothing below a task class's own keys: json-schema-library does not resolve the "$ref" of
an "additionalProperties" schema, so the editor inlines the schema's references, src/schema.js). The editor
keeps its width on the first click (it shrank to its content: 871 -> 88 px here) and a blank draft starts as
a document, not ``null`` (both fixed with 4cab3f1 and 4aaadc0; these tests fail on the code before them).
Screenshots go to ``artifacts/screenshots/`` (``<width>-editor-<step>``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from budgeting.backoffice.roles import sync_roles
from budgeting.catalog.models import PolicyAlias, PolicyState, PolicyVersion
from tests.admin.conftest import make_user, policy_document
from tests.e2e import test_browser
from tests.e2e.test_browser import DESKTOP, PHONE, Screen

pytestmark = test_browser.pytestmark
browser = test_browser.browser

ADD_DRAFT = "/admin/budgeting/policyversion/add/"


@pytest.fixture
def platform(transactional_db) -> None:
    # An earlier transactional test's flush may have emptied the groups the data migration made.
    sync_roles()
    make_user("platform", role="platform")


@pytest.fixture
def active_policy(platform) -> PolicyVersion:
    """r18 active as production: a new draft starts from its document (one task class, contract-review)."""
    r18 = PolicyVersion.objects.create(revision=18, state=PolicyState.VALIDATED, document=policy_document(18))
    PolicyAlias.objects.create(name="production", version=r18)
    return r18


def open_editor(browser: Any, live_server: Any, width: int = DESKTOP) -> Screen:
    screen = Screen(browser, live_server.url, "platform", width)
    screen.go(ADD_DRAFT)
    screen.page.wait_for_selector(".cm-editor .cm-content")
    return screen


def text_box(screen: Screen, text: str, after: str | None = None) -> dict[str, float]:
    """The on-screen box of the first occurrence of ``text`` in the editor (after ``after``, when given)."""
    box: dict[str, float] | None = screen.page.evaluate(
        """([text, after]) => {
             const content = document.querySelector('.cm-editor .cm-content');
             const walker = document.createTreeWalker(content, NodeFilter.SHOW_TEXT);
             let seen = after === null;
             for (let node = walker.nextNode(); node; node = walker.nextNode()) {
               if (!seen) { seen = node.textContent.includes(after); continue; }
               const at = node.textContent.indexOf(text);
               if (at < 0) continue;
               const range = document.createRange();
               range.setStart(node, at);
               range.setEnd(node, at + text.length);
               const r = range.getBoundingClientRect();
               return {x: r.left, y: r.top, width: r.width, height: r.height};
             }
             return null;
           }""",
        [text, after],
    )
    assert box is not None, f"{text!r} is not in the editor"
    return box


def hover_text(screen: Screen, text: str, after: str) -> str:
    """Hover the middle of ``text`` (the first after ``after``) and return what the hover tooltip says."""
    # Off the text first, so that the tooltip waited for is this text's, not the last one's.
    screen.page.mouse.move(0, 0)
    screen.page.wait_for_selector(".cm-tooltip-hover", state="detached")
    box = text_box(screen, text, after)
    screen.page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    tooltip = screen.page.wait_for_selector(".cm-tooltip-hover")
    assert tooltip is not None
    return tooltip.inner_text()


def editor_width(screen: Screen) -> float:
    return float(screen.page.evaluate("document.querySelector('.cm-editor').getBoundingClientRect().width"))


def test_hover_inside_a_task_class_shows_the_field_description(browser, live_server, active_policy):
    screen = open_editor(browser, live_server)
    # At the top level the schema's help was always there: the control.
    assert "Global cap on the input tokens" in hover_text(screen, "globalMaxInputTokens", after="{")
    said = hover_text(screen, "inputCap", after="contract-review")
    screen.shot("editor-hover-task-class")
    assert "Cap on a request" in said and "input tokens for this task class." in said, said
    said = hover_text(screen, "countingUnavailable", after="contract-review")
    assert "What admission does when exact counting is unavailable." in said, said
    assert "REJECT" in said and "UPPER_BOUND" in said, said
    said = hover_text(screen, "contract-review", after="taskClasses")
    assert "The policy of one task class" in said, said


def completions(screen: Screen) -> set[str]:
    """Ask for completion where the cursor is (Ctrl-Space) and return the labels offered."""
    screen.page.keyboard.press("Control+Space")
    screen.page.wait_for_selector(".cm-tooltip-autocomplete", timeout=5_000)
    return set(screen.page.locator(".cm-tooltip-autocomplete .cm-completionLabel").all_inner_texts())


def test_completion_inside_a_task_class_offers_its_keys(browser, live_server, active_policy):
    screen = open_editor(browser, live_server)
    page = screen.page
    box = text_box(screen, "contract-review")
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.move(0, 0)  # no hover tooltip over the list
    page.keyboard.press("End")
    page.keyboard.press("Enter")
    page.keyboard.type('"')
    # The fields a task class may have and this one does not have yet.
    offered = completions(screen)
    assert {"minimumEvidence", "compaction", "essentialTools", "queue", "fallbackModels"} <= offered, offered
    assert not offered & {"inputCap", "outputCap", "rampPercent"}, offered
    page.keyboard.press("Escape")
    # One level down, in an object of the task class: its own fields (offered nothing before).
    page.keyboard.type('queue": {')
    page.keyboard.press("Enter")
    page.keyboard.type('"')
    offered = completions(screen)
    screen.shot("editor-completion-task-class")
    assert offered == {"allowed", "deadlineSeconds"}, offered
    page.keyboard.press("Escape")
    # A field's values: countingUnavailable's two (offered nothing before).
    box = text_box(screen, "REJECT", after="countingUnavailable")
    page.mouse.dblclick(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.keyboard.press("Backspace")
    offered = completions(screen)
    assert offered == {"REJECT", "UPPER_BOUND"}, offered


@pytest.mark.parametrize("width", [DESKTOP, PHONE])
def test_the_editor_keeps_its_width_on_the_first_click(browser, live_server, active_policy, width):
    screen = open_editor(browser, live_server, width)
    before = editor_width(screen)
    screen.page.click(".cm-editor .cm-content")
    screen.page.keyboard.press("End")
    screen.page.wait_for_function("document.activeElement.closest('.cm-editor') !== null")
    after = editor_width(screen)
    screen.shot("editor-after-first-click")
    assert after == pytest.approx(before, abs=1), (before, after)
    assert after > width * (0.5 if width == DESKTOP else 0.8), (width, after)


def test_a_blank_draft_starts_as_a_document_not_null(browser, live_server, platform):
    screen = open_editor(browser, live_server)
    screen.shot("editor-blank-draft")
    shown = screen.page.inner_text(".cm-editor .cm-content")
    assert json.loads(shown) == {"revision": 1, "taskClasses": {}}, shown

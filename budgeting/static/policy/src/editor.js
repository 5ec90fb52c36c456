// The policy editor: CodeMirror 6 with JSON highlighting, parse errors, and the published policy JSON Schema
// (its local $refs inlined first, see schema.js) for completion, hover help and inline errors. Bundled into
// ../editor.js (see ../README.md); the textarea it replaces stays the form field, so the page still works
// without JavaScript.
import { EditorView, basicSetup } from "codemirror";
import { EditorState } from "@codemirror/state";
import { linter, lintGutter } from "@codemirror/lint";
import { hoverTooltip } from "@codemirror/view";
import { json, jsonLanguage, jsonParseLinter } from "@codemirror/lang-json";
import {
  handleRefresh,
  jsonCompletion,
  jsonSchemaHover,
  jsonSchemaLinter,
  stateExtensions,
} from "codemirror-json-schema";
import { inlineRefs } from "./schema.js";

function attach(textarea, schema) {
  const readOnly = textarea.hasAttribute("readonly");
  const view = new EditorView({
    parent: textarea.parentNode,
    state: EditorState.create({
      doc: textarea.value,
      extensions: [
        basicSetup,
        json(),
        lintGutter(),
        linter(jsonParseLinter(), { delay: 300 }),
        linter(jsonSchemaLinter(), { needsRefresh: handleRefresh }),
        jsonLanguage.data.of({ autocomplete: jsonCompletion() }),
        hoverTooltip(jsonSchemaHover()),
        stateExtensions(schema),
        EditorState.readOnly.of(readOnly),
        EditorView.updateListener.of((update) => {
          if (update.docChanged) textarea.value = update.state.doc.toString();
        }),
      ],
    }),
  });
  textarea.parentNode.insertBefore(view.dom, textarea);
  textarea.hidden = true;
  return view;
}

function start() {
  const source = document.getElementById("policy-schema");
  if (!source) return;
  const schema = inlineRefs(JSON.parse(source.textContent));
  document.querySelectorAll("textarea[data-policy-editor]").forEach((t) => attach(t, schema));
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();

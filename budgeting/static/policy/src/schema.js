// The policy JSON Schema as the editor's schema library can walk it: every local "$ref" ("#/definitions/…")
// replaced by the schema it points at. json-schema-library 9.3.5 (what codemirror-json-schema 0.8.1 walks the
// schema with) resolves a "$ref" under "properties" but returns an "additionalProperties" schema as written:
// below taskClasses.<slug>, a {"$ref": "#/definitions/taskPolicy"} with no properties, so every field of a
// task class got a type guessed from its value ("string"), no description and no completion.
// A "$ref" met again inside its own expansion (a recursive schema) is left as it is.

function pointAt(root, ref) {
  let node = root;
  for (const part of ref.slice(2).split("/")) {
    const key = part.replace(/~1/g, "/").replace(/~0/g, "~");
    if (node === null || typeof node !== "object" || !(key in node)) return undefined;
    node = node[key];
  }
  return node;
}

export function inlineRefs(root) {
  function walk(node, expanding) {
    if (Array.isArray(node)) return node.map((item) => walk(item, expanding));
    if (node === null || typeof node !== "object") return node;
    const ref = node.$ref;
    if (typeof ref === "string" && ref.startsWith("#/") && !expanding.has(ref)) {
      const target = pointAt(root, ref);
      if (target !== undefined) {
        // Draft 7 ignores a "$ref"'s siblings for validation; kept here for what they say (a description).
        const { $ref, ...siblings } = node;
        return { ...walk(target, new Set(expanding).add(ref)), ...walk(siblings, expanding) };
      }
    }
    const out = {};
    for (const [key, value] of Object.entries(node)) out[key] = walk(value, expanding);
    return out;
  }
  return walk(root, new Set());
}

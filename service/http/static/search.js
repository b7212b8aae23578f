// The search page: one form, POST /search, results and the answer's per-stage latency.
// Plain script, nothing fetched from elsewhere; the API key (when the service has one) stays in
// this tab's sessionStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const STAGES = ["queue", "encode", "retrieve", "rerank"];
const KEY = "dense-search-api-key";
const keyRequired = document.body.dataset.keyRequired === "true";
let cards = [];  // the index's candidate structures with their recall cards (/ready)
let fields = {};  // the index's metadata fields and their types (/ready): a filter may name them

function headers() {
  const result = { "content-type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) result.authorization = `Bearer ${key}`;
  return result;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function reason(status, body) {
  if (status === 401) return "401: missing or wrong API key. Enter the service's key above.";
  const detail = body && body.detail;
  if (Array.isArray(detail)) return `${status}: ${detail.map((d) => d.msg).join("; ")}`;
  if (typeof detail === "string") return `${status}: ${detail}`;
  return `${status}: the service could not answer`;
}

async function describeIndex() {
  try {
    const answer = await fetch("/ready", { headers: headers() });  // where a key is set, only its holder sees the index
    const body = await answer.json();
    if (!answer.ok || !body.index) {
      $("index").textContent = `index ${body.status}${body.detail ? ": " + body.detail : ""}`;
      return;
    }
    const index = body.index;
    $("index").textContent = `${index.count.toLocaleString()} passages · ${index.model} · ${index.similarity} · ${index.backend}`;
    for (const option of $("mode").options) option.disabled = option.value !== "dense" && option.value && !index.bm25;
    const kinds = Object.keys(index.rerankers);
    $("reranker").replaceChildren(...kinds.map((kind) => new Option(kind, kind)));
    $("rerank-label").hidden = $("reranker-label").hidden = kinds.length === 0;
    cards = index.candidates || [];
    $("exact-label").hidden = cards.length === 0;
    fields = index.fields || {};
    const names = Object.keys(fields);
    $("filter-box").hidden = names.length === 0;
    if (names.length) {
      $("filter-note").textContent = `JSON, e.g. {"${names[0]}": {"$in": [...]}}; fields: ` +
        names.map((name) => `${name} (${fields[name]})`).join(", ");
    }
  } catch (error) {
    $("index").textContent = "the service is not answering";
  }
}

function drawLatency(latency) {
  const total = latency.total || STAGES.reduce((sum, stage) => sum + (latency[stage] || 0), 0) || 1;
  const bar = $("latency");
  bar.replaceChildren(...STAGES.filter((stage) => latency[stage] > 0).map((stage) => {
    const part = document.createElement("span");
    part.className = `stage-${stage}`;
    part.style.width = `${(100 * latency[stage]) / total}%`;
    part.title = `${stage} ${latency[stage].toFixed(1)} ms`;
    return part;
  }));
  const words = STAGES.filter((stage) => stage in latency).map((stage) => `${stage} ${latency[stage].toFixed(1)} ms`);
  bar.setAttribute("aria-label", `latency: ${words.join(", ")}; total ${total.toFixed(1)} ms`);
  $("legend").replaceChildren(...STAGES.filter((stage) => latency[stage] > 0).map((stage) => {
    const item = document.createElement("li");
    const swatch = document.createElement("i");
    swatch.className = `stage-${stage}`;
    item.append(swatch, `${stage} ${latency[stage].toFixed(1)} ms`);
    return item;
  }));
}

// How the dense list was found, from the answer's `search`: "exact", or "approximate: KIND" with the
// structure's recall card (recall@10 against the exact scan, and what it was measured on); over shards,
// each shard's card (measured on its own passages), so the range and the queries of all of them.
function describeSearch(searched) {
  if (!searched.startsWith("approximate:")) return searched;
  const kind = searched.slice("approximate:".length);
  const held = cards.filter((card) => card.kind === kind);
  if (held.length === 0) return `approximate: ${kind}`;
  const recalls = held.map((card) => card.recall_at_10);
  const low = Math.min(...recalls).toFixed(3), high = Math.max(...recalls).toFixed(3);
  const sample = held.reduce((sum, card) => sum + card.sample, 0).toLocaleString();
  const on = held[0].recall_queries === "held-out passages" ? `${sample} held-out passages`
    : `${sample} queries of ${held[0].recall_queries}`;
  const shards = held.length > 1 ? ` over ${held.length} shards` : "";
  return `approximate: ${kind}, recall@10 ${low === high ? low : `${low} to ${high}`}${shards} measured on ${on}`;
}

function drawResults(body) {
  const items = body.results.map((hit) => {
    const item = document.createElement("li");
    const head = document.createElement("div");
    head.className = "hit-head";
    const rank = Object.assign(document.createElement("span"), { className: "hit-rank", textContent: `#${hit.rank}` });
    const id = Object.assign(document.createElement("span"), { className: "hit-id", textContent: hit.id });
    const score = Object.assign(document.createElement("span"), {
      className: "hit-score", textContent: `${body.score_kind} ${hit.score.toFixed(4)}` });
    head.append(rank, id, score);
    if (hit.retrieval_score !== null && hit.retrieval_score !== undefined) {
      head.append(Object.assign(document.createElement("span"), { textContent: `retrieval ${hit.retrieval_score.toFixed(4)}` }));
    }
    const text = Object.assign(document.createElement("p"), { className: "hit-text", textContent: hit.text });
    item.append(head, text);
    if (hit.fields && Object.keys(hit.fields).length) {
      const shown = Object.entries(hit.fields).map(([name, value]) =>
        `${name}: ${Array.isArray(value) ? value.join(", ") : value}`).join(" · ");
      item.append(Object.assign(document.createElement("p"), { className: "hit-fields muted", textContent: shown }));
    }
    return item;
  });
  $("results").replaceChildren(...items);
  // The mode that ran: the one asked, or the service's default (hybrid where the index has BM25).
  $("summary").textContent = `${body.results.length} results · ${body.mode} · ${body.latency_ms.total.toFixed(1)} ms`;
  // Said where the index carries a structure, the only case where a search could be answered otherwise.
  $("searched").textContent = describeSearch(body.search || "exact");
  $("searched").hidden = cards.length === 0;
  drawLatency(body.latency_ms);
  $("answer").hidden = false;
}

async function search(event) {
  event.preventDefault();
  const request = { query: $("query").value, k: Number($("k").value) };
  if ($("mode").value) request.mode = $("mode").value;  // none: the service's default
  if ($("rerank").checked && !$("rerank-label").hidden) {
    request.rerank = true;
    request.reranker = $("reranker").value;
  }
  if ($("exact").checked && !$("exact-label").hidden) request.exact = true;
  if (!$("filter-box").hidden) {
    request.fields = true;  // shown under each result
    const filter = $("filter").value.trim();
    if (filter) {
      try {
        request.filter = JSON.parse(filter);
      } catch (error) {
        $("answer").hidden = true;
        showError(`filter: not valid JSON (${error.message})`);
        return;
      }
    }
  }
  showError("");
  try {
    const answer = await fetch("/search", { method: "POST", headers: headers(), body: JSON.stringify(request) });
    const body = await answer.json().catch(() => null);
    if (!answer.ok) {
      if (answer.status === 401) $("key-box").hidden = false;
      $("answer").hidden = true;
      showError(reason(answer.status, body));
      return;
    }
    drawResults(body);
  } catch (error) {
    showError(`the service is not answering (${error.message})`);
  }
}

$("key").value = sessionStorage.getItem(KEY) || "";
$("key-box").hidden = !keyRequired;
$("key").addEventListener("input", () => sessionStorage.setItem(KEY, $("key").value));
$("key").addEventListener("change", describeIndex);
$("search").addEventListener("submit", search);
describeIndex();

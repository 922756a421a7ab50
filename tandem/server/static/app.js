// The page's entry point: asks for the API key when the server wants one, then starts the chat and
// the cluster view.

import { api, ApiError, apiKey, AuthRequired, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { ClusterPanel } from "./cluster.js";

const $ = (id) => document.getElementById(id);
let model = "";
let chat = null;

const cluster = new ClusterPanel(
  {
    state: $("cluster-state"),
    detail: $("cluster-detail"),
    layout: $("layout"),
    tokensPerS: $("tokens-per-s"),
    decodeMs: $("decode-ms"),
    load: $("load"),
    generated: $("generated"),
    wire: $("wire"),
    prefixCache: $("prefix-cache"),
    ranks: $("ranks").tBodies[0],
    links: $("links").tBodies[0],
    plot: $("tps-plot"),
  },
  askForKey,
);

function askForKey(message) {
  cluster.setState("locked", "an API key is needed");
  $("main").hidden = true;
  $("key-panel").hidden = false;
  const err = $("key-error");
  err.textContent = message || "";
  err.hidden = !message;
  $("key-input").focus();
}

function showPage() {
  $("key-panel").hidden = true;
  $("main").hidden = false;
  if (chat === null) {
    chat = new Chat(
      {
        messages: $("messages"),
        error: $("chat-error"),
        form: $("chat-form"),
        input: $("chat-input"),
        send: $("send"),
        stop: $("stop"),
        clear: $("clear"),
        temperature: $("temperature"),
        maxTokens: $("max-tokens"),
        stopStrings: $("stop-strings"),
        systemPrompt: $("system-prompt"),
      },
      () => model,
      () => cluster.latest,
      () => askForKey("The server refused the key."),
    );
  }
  cluster.start();
}

async function connect() {
  try {
    const resp = await api("/v1/models");
    const body = await resp.json();
    model = body.data[0].id;
  } catch (err) {
    if (err instanceof AuthRequired) {
      askForKey(apiKey() ? "That key was refused." : "");
    } else if (err instanceof ApiError) {
      showPage(); // it answers but serves no model yet: the cluster is forming
      setTimeout(connect, 1000);
    } else {
      cluster.setState("unreachable", `the server does not answer (${err.message})`);
      setTimeout(connect, 2000);
    }
    return;
  }
  $("model-name").textContent = model;
  showPage();
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setApiKey($("key-input").value);
  $("key-input").value = "";
  connect();
});

connect();

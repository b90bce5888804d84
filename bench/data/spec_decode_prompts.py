"""Prompts of the speculative-decoding study (bench/spec_decode.py, notebook 08).

Three kinds a serving system meets: summarising a given passage, open chat,
and code completion. All text below was written for this repository (no
outside source) and is under the repository's license.
"""

PASSAGE = (
    "The town of Alder Bay sits where a slow river meets a cold northern sea. For most of its history the town "
    "lived from fishing: every morning the boats left the harbour before dawn and came back in the afternoon, "
    "and the market by the old stone bridge sold what they brought. In the last twenty years the fish moved "
    "further north, and many families left. Those who stayed opened small guest houses, a museum about the "
    "fishing fleet, and a ferry that carries visitors to the islands in summer. The old stone bridge, once a "
    "market, is now the place where visitors take photographs of the harbour. The town council wants to build "
    "a new pier for larger ships, but many residents fear that larger ships would bring crowds that the narrow "
    "streets cannot hold. The council will decide in the spring after a public meeting in the town hall."
)

SUMMARISE = [
    f"Summarise the following passage in three sentences.\n\n{PASSAGE}",
    f"Read the passage and list the main problems the town faces.\n\n{PASSAGE}",
    f"Write a short summary of this passage for a newspaper.\n\n{PASSAGE}",
]

CHAT = [
    "What is the capital of France, and what is it famous for?",
    "Give me three tips for sleeping better at night.",
    "Explain what a cache is to a ten-year-old.",
]

CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\ndef multiply(a, b):\n"
    "    return a * b\n\n\ndef divide(a, b):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n",
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def save_config(path, config):\n",
]

KINDS = {"code": CODE, "summarise": SUMMARISE, "chat": CHAT}
"""kind -> prompts. Chat and summarise prompts are sent through the chat template; code is raw text."""
CHAT_TEMPLATE_KINDS = ("summarise", "chat")

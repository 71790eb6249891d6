"""Small helpers over token id lists."""

from __future__ import annotations

from typing import Hashable

_CHUNK = 256


def common_prefix_length(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    index = 0
    # Whole chunks compare in C; only the chunk holding the first difference is walked.
    while index + _CHUNK <= limit and a[index : index + _CHUNK] == b[index : index + _CHUNK]:
        index += _CHUNK
    while index < limit and a[index] == b[index]:
        index += 1
    return index


class _Node:
    """A radix tree node: the edge into it is `source[start:end]` (positions in the sequence,
    which every sequence below it shares, so any of them can be the source)."""

    __slots__ = ("source", "start", "end", "children", "keys")

    def __init__(self, source: list[int], start: int, end: int) -> None:
        self.source = source
        self.start = start
        self.end = end
        self.children: dict[int, _Node] = {}  # by the first token of their edge
        self.keys: set[Hashable] = set()  # sequences that end here


class PrefixIndex:
    """Token sequences by key, each in a namespace (sequences of two namespaces never match),
    answering "which shares the longest prefix with this prompt" in time that grows with the
    prompt, not with how many sequences are held (a cache of thousands would otherwise compare
    every one at every admission): a radix tree per namespace."""

    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}
        self._held: dict[Hashable, tuple[str, list[int]]] = {}  # key -> (namespace, tokens)

    def __len__(self) -> int:
        return len(self._held)

    def add(self, key: Hashable, tokens: list[int], namespace: str = "") -> None:
        if key in self._held:
            self.remove(key)
        self._held[key] = namespace, tokens
        node, depth = self._roots.setdefault(namespace, _Node([], 0, 0)), 0
        while True:
            if depth == len(tokens):
                node.keys.add(key)
                return
            child = node.children.get(tokens[depth])
            if child is None:
                node.children[tokens[depth]] = leaf = _Node(tokens, depth, len(tokens))
                leaf.keys.add(key)
                return
            matched = _edge_match(child, tokens)
            if child.start + matched < child.end:  # split the edge where they part
                middle = _Node(child.source, child.start, child.start + matched)
                middle.children[child.source[middle.end]] = child
                child.start = middle.end
                node.children[tokens[depth]] = child = middle
            node, depth = child, child.end

    def remove(self, key: Hashable) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        namespace, tokens = held
        root = self._roots[namespace]
        path, node, depth = [root], root, 0
        while depth < len(tokens):
            node = node.children[tokens[depth]]
            depth = node.end
            path.append(node)
        node.keys.discard(key)
        # Drop nodes left without sequences, and merge a node left with one child into it.
        while len(path) > 1 and not path[-1].keys and len(path[-1].children) <= 1:
            node = path.pop()
            if node.children:
                (child,) = node.children.values()
                child.start = node.start
                path[-1].children[node.source[node.start]] = child
            else:
                del path[-1].children[node.source[node.start]]
        if not root.keys and not root.children:
            del self._roots[namespace]
            return
        # Edges read from the removed sequence read from one still held below them instead,
        # so the index never keeps a removed sequence's tokens alive.
        for node in path[1:]:
            if node.source is tokens:
                node.source = self._held[_held_below(node)][1]

    def longest_prefix(self, tokens: list[int], namespace: str = "") -> tuple[Hashable | None, int]:
        """A key of `namespace` whose sequence shares the longest prefix with `tokens` (one that
        ends there, if any does), and that prefix's length; (None, 0) when none shares a token."""
        node, depth = self._roots.get(namespace), 0
        if node is None:
            return None, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            matched = _edge_match(child, tokens)
            node, depth = child, child.start + matched
            if depth < child.end:
                break
        return (_held_below(node), depth) if depth else (None, 0)

    def prefixes_of(self, tokens: list[int], namespace: str = "") -> list[Hashable]:
        """Keys of the sequences of `namespace` that are prefixes of `tokens` (equal ones
        included)."""
        node, depth = self._roots.get(namespace), 0
        if node is None:
            return []
        found = list(node.keys)
        while depth < len(tokens):
            node = node.children.get(tokens[depth])
            if node is None or node.start + _edge_match(node, tokens) < node.end:
                break
            depth = node.end
            found.extend(node.keys)
        return found


def _held_below(node: _Node) -> Hashable:
    """A sequence that ends at `node` or below it (every leaf holds one), the nearest on the
    first branch."""
    while not node.keys:
        node = next(iter(node.children.values()))
    return next(iter(node.keys))


def _edge_match(node: _Node, tokens: list[int]) -> int:
    """How many tokens of the edge into `node` `tokens` follows."""
    return common_prefix_length(node.source[node.start:node.end], tokens[node.start:node.end])

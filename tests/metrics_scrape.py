"""Scraping helpers for the metrics tests: fetch /metrics over HTTP and parse it with prometheus_client."""

from __future__ import annotations

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    """{(sample name, labels): value} of an exposition text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int, timeout: float = 2.0) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    return text, parse(text)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls)


def check_counters_increase(series: list[Samples]) -> int:
    """Assert no `_total` sample ever decreases between consecutive scrapes; returns the comparisons made."""
    compared = 0
    for before, after in zip(series, series[1:]):
        for key, value in before.items():
            if key[0].endswith("_total") and key in after:
                assert after[key] >= value, f"counter {key[0]} {dict(key[1])} went down: {value} -> {after[key]}"
                compared += 1
    return compared


class Scraper:
    """Scrapes `ports` every `interval` seconds in a thread until stopped; keeps every successful scrape."""

    def __init__(self, ports: list[int], interval: float = 0.05):
        self.ports, self.interval = ports, interval
        self.texts: dict[int, list[str]] = {p: [] for p in ports}
        self.series: dict[int, list[Samples]] = {p: [] for p in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for port in self.ports:
                try:
                    text, samples = scrape(port, timeout=1.0)
                except OSError:
                    continue  # not up yet, or gone
                # A scrape in flight when the trainer stops its endpoint can still end with the status line
                # and no body (the endpoint's handler threads are daemons): no scrape.
                if not text:
                    continue
                self.texts[port].append(text)
                self.series[port].append(samples)
            self._stop.wait(self.interval)

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

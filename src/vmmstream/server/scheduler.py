"""The scheduler: one worker thread owns the engine; the HTTP layer (an asyncio loop) hands it jobs.

    job = scheduler.submit(prepared)     # on the event loop; Rejected (429) when the queue is full
    await job.admitted()                 # waits for a free slot up to the deadline: Rejected (429 / 503)
    async for tokens in job.events():    # the tokens as the engine makes them
        ...
    job.cancel()                         # the client went away: ended at the next step, its slot freed

Admission happens before a response begins, so a refusal is a plain 429 with ``Retry-After`` (I9), never a
broken stream. The worker runs the continuous batching loop of ``SequenceEngine`` (``engine.py``): cancel,
admit, step, deliver; tokens cross to the loop with ``call_soon_threadsafe``. The engine never waits for a
slow client: its tokens queue on the job.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time

from ..errors import CapacityError

QUEUED, RUNNING, DONE = "queued", "running", "done"


class Rejected(Exception):
    """A request refused before its response began: ``status`` 429 (``code`` queue_full, queue_timeout,
    capacity) or 503 (shutting_down), with ``retry_after`` seconds."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.code, self.retry_after = status, code, retry_after


class Job:
    """One request between the HTTP handler (its event loop) and the worker. ``state`` and ``cancelled``
    change under the scheduler's lock; the events queue is touched only on the loop."""

    def __init__(self, scheduler, prepared, loop, arrival: float, deadline: float):
        self.scheduler, self.prepared, self.loop = scheduler, prepared, loop
        self.arrival, self.deadline = arrival, deadline
        self.state = QUEUED
        self.cancelled = False
        self.seq = None
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finish_reason: str | None = None
        self._started = loop.create_future()
        self._events: asyncio.Queue = asyncio.Queue()

    @property
    def prompt_tokens(self) -> int:
        return self.prepared.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self.seq.completion_tokens if self.seq is not None else 0

    async def admitted(self) -> None:
        """Return once the job runs (its first tokens are on their way); ``Rejected`` if the queue deadline
        passes first or the engine refuses it; the engine's error if its start failed."""
        try:
            try:
                await asyncio.wait_for(asyncio.shield(self._started), max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                if self.scheduler.withdraw(self):
                    raise self.scheduler.timed_out() from None
                await self._started          # taken by the worker just now: it starts
        except asyncio.CancelledError:       # the client went away while it waited
            self.cancel()
            raise

    async def events(self):
        """The token lists as they come; ends when the sequence ends (``finish_reason`` set), raises the
        engine's error if it failed midway."""
        while True:
            kind, value = await self._events.get()
            if kind == "tokens":
                yield value
            elif kind == "end":
                return
            else:
                raise value

    def cancel(self) -> None:
        """The client is gone: drop the job from the queue, or end its sequence at the next step. Idempotent."""
        self.scheduler.cancel(self)

    # worker side: hand results to the loop
    def _post(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:                 # the loop is closed: nobody is listening any more
            pass

    def _resolve(self, exc: BaseException | None = None) -> None:
        def done():
            if not self._started.done():
                if exc is None:
                    self._started.set_result(None)
                else:
                    self._started.set_exception(exc)
                    self._started.exception()      # retrieved: a handler that left first leaves no warning
        self._post(done)


class Scheduler:
    """The worker thread and its bounded queue. ``max_queue`` requests wait at most ``queue_timeout`` seconds
    for the engine to admit them; ``drain()`` refuses new and queued requests with 503 and lets the running
    ones finish; ``close()`` ends everything and joins the worker."""

    def __init__(self, engine, *, max_queue: int = 64, queue_timeout: float = 30.0, metrics=None):
        self.engine = engine
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.metrics = metrics
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._active: dict = {}               # Sequence -> Job
        self._draining = self._stopping = False
        self._wait_for_finish = False         # the engine refused for capacity: admit again once one ends
        self._service_s = 1.0                 # moving average of a request's time on the engine
        self._thread = threading.Thread(target=self._run, name="vmmstream-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Scheduler:
        self._thread.start()
        return self

    # ------------------------------------------------------------------------------ event-loop side
    def submit(self, prepared, *, arrival: float | None = None) -> Job:
        """Queue ``prepared`` (on the event loop); ``Rejected`` at once when draining or the queue is full."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        job = Job(self, prepared, loop, arrival if arrival is not None else now, now + self.queue_timeout)
        with self._cond:
            if self._draining or self._stopping:
                raise self._rejected(Rejected(503, "shutting_down", "the server is shutting down; retry on "
                                              "another replica or after it restarts", retry_after=5))
            if len(self._queue) >= self.max_queue:
                raise self._rejected(Rejected(
                    429, "queue_full", f"the server is at capacity: {len(self._active)} running, "
                    f"{len(self._queue)} waiting (queue of {self.max_queue}); retry later",
                    retry_after=self._retry_after()))
            self._queue.append(job)
            self._gauges()
            self._cond.notify()
        return job

    def withdraw(self, job: Job) -> bool:
        """Take a job out of the queue before the worker starts it; False if it started (or ended) already."""
        with self._cond:
            if job.state != QUEUED:
                return False
            self._queue.remove(job)
            job.state = DONE
            self._gauges()
            return True

    def timed_out(self) -> Rejected:
        return self._rejected(Rejected(
            429, "queue_timeout", f"no capacity within the queue deadline of {self.queue_timeout:g} s; retry "
            "later", retry_after=self._retry_after()))

    def cancel(self, job: Job) -> None:
        with self._cond:
            if job.cancelled or job.state == DONE:
                return
            job.cancelled = True
            if job.state == QUEUED:
                self._queue.remove(job)
                job.state = DONE
                self._gauges()
            self._cond.notify()

    def drain(self) -> None:
        """Stop admitting: new and queued requests get 503; the running ones go on to their end."""
        with self._cond:
            self._draining = True
            while self._queue:
                job = self._queue.popleft()
                job.state = DONE
                job._resolve(self._rejected(Rejected(503, "shutting_down", "the server is shutting down",
                                                     retry_after=5)))
            self._gauges()

    @property
    def draining(self) -> bool:
        return self._draining

    def counts(self) -> tuple[int, int]:
        """(running, waiting)"""
        with self._cond:
            return len(self._active), len(self._queue)

    def close(self, timeout: float = 10.0) -> None:
        """End the running sequences at the next step, refuse the queued ones, and join the worker."""
        self.drain()
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _retry_after(self) -> int:
        """Seconds until a slot is likely free: the queue ahead times a request's average time on the engine."""
        waits = (len(self._queue) + 1) * self._service_s / max(1, self.engine.max_batch)
        return int(min(60, max(1, math.ceil(waits))))

    def _rejected(self, r: Rejected) -> Rejected:
        if self.metrics is not None:
            self.metrics.rejected(r.code)
        return r

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_load(queued=len(self._queue), running=len(self._active))

    # ---------------------------------------------------------------------------------- the worker
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._active or (self._queue and not self._wait_for_finish)):
                        self._cond.wait()
                    if self._stopping:
                        break
                    gone = [j for j in self._active.values() if j.cancelled]
                    admit = [] if self._wait_for_finish else self._admissible()
                for job in gone:
                    self._end(job, "cancelled", cancel=True)
                if len(admit) > 1 and hasattr(self.engine, "add_many"):
                    self._start_many(admit)          # their prompts prefilled together
                else:
                    for job in admit:
                        self._start(job)
                if self._active:
                    self._step()
        except BaseException as exc:         # a bug in the loop itself: fail everything, refuse from now on
            self.error = exc
            raise
        finally:
            with self._cond:
                self._stopping = True
                running = list(self._active.values())
            for job in running:
                self._end(job, "cancelled", cancel=True,
                          error=RuntimeError("the server stopped before this answer was finished"))
            self.drain()

    def _admissible(self) -> list[Job]:
        """With the lock held: the queued jobs to start now, in order (expired ones refused with 429)."""
        now, out = time.monotonic(), []
        while self._queue and len(self._active) + len(out) < self.engine.max_batch:
            job = self._queue[0]
            if job.deadline <= now:
                self._queue.popleft()
                job.state = DONE
                job._resolve(self.timed_out())
                continue
            if not self.engine.can_admit(job.prepared, len(self._active) + len(out)):
                break
            self._queue.popleft()
            job.state = RUNNING
            out.append(job)
        self._gauges()
        return out

    def _start(self, job: Job) -> None:
        if job.cancelled:
            with self._cond:
                job.state = DONE
            return
        t0 = time.monotonic()
        try:
            seq, tokens, finish = self.engine.add(job.prepared)
        except CapacityError as exc:
            self._refused(job, exc)
            return
        except Exception as exc:
            with self._cond:
                job.state = DONE
            job._resolve(exc)
            return
        self._started(job, seq, tokens, finish, t0)

    def _start_many(self, jobs: list[Job]) -> None:
        """Start ``jobs`` with one ``add_many``: the ones it started run; the rest go back to the front of the
        queue, in order (tried again at once; a capacity refusal of the first waits as ``_start``'s does)."""
        with self._cond:
            for job in jobs:
                if job.cancelled:
                    job.state = DONE
            jobs = [j for j in jobs if not j.cancelled]
        if not jobs:
            return
        t0 = time.monotonic()
        try:
            started = self.engine.add_many([j.prepared for j in jobs])
        except CapacityError as exc:
            for job in reversed(jobs[1:]):
                self._requeue(job)
            self._refused(jobs[0], exc)
            return
        except Exception as exc:
            with self._cond:
                for job in jobs:
                    job.state = DONE
            for job in jobs:
                job._resolve(exc)
            return
        for job in reversed(jobs[len(started):]):
            self._requeue(job)
        for job, (seq, tokens, finish) in zip(jobs, started):
            self._started(job, seq, tokens, finish, t0)

    def _requeue(self, job: Job) -> None:
        with self._cond:
            job.state = QUEUED
            self._queue.appendleft(job)
            self._gauges()

    def _refused(self, job: Job, exc: CapacityError) -> None:
        with self._cond:
            if self._active:             # memory frees when a running sequence ends: wait for that
                job.state = QUEUED
                self._queue.appendleft(job)
                self._wait_for_finish = True
                self._gauges()
                return
            job.state = DONE
        job._resolve(self._rejected(Rejected(429, "capacity", f"the model's memory cannot hold this request "
                                             f"now: {exc}", retry_after=self._retry_after())))

    def _started(self, job: Job, seq, tokens, finish, t0: float) -> None:
        job.seq, job.started_at = seq, t0
        with self._cond:
            self._active[seq] = job
            self._gauges()
        if self.metrics is not None:
            self.metrics.started(job.prompt_tokens, t0 - job.arrival)
        job._resolve()
        self._deliver(job, tokens, finish)

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception as exc:             # the engine failed: every running answer ends with the error
            for job in list(self._active.values()):
                self._end(job, "error", cancel=True, error=exc)
            return
        for seq, tokens, finish in results:
            job = self._active.get(seq)
            if job is not None:
                self._deliver(job, tokens, finish)

    def _deliver(self, job: Job, tokens: list, finish: str | None) -> None:
        now = time.monotonic()
        if tokens:
            m = self.metrics
            if m is not None:
                m.tokens_out(len(tokens))
                if job.first_token_at is None:
                    m.first_token(now - job.arrival)
                    m.inter_token(0.0, len(tokens) - 1)
                else:
                    m.inter_token(now - job.last_token_at, 1)
                    m.inter_token(0.0, len(tokens) - 1)
            if job.first_token_at is None:
                job.first_token_at = now
            job.last_token_at = now
            job._post(job._events.put_nowait, ("tokens", tokens))
        if finish is not None:
            self._end(job, finish)

    def _end(self, job: Job, finish: str, *, cancel: bool = False, error: BaseException | None = None) -> None:
        if cancel and job.seq is not None:
            try:
                self.engine.cancel(job.seq)
            except Exception as exc:         # the answer is over either way
                error = error or exc
        with self._cond:
            self._active.pop(job.seq, None)
            job.state = DONE
            job.finish_reason = finish
            self._wait_for_finish = False
            if job.started_at is not None:
                self._service_s = 0.8 * self._service_s + 0.2 * (time.monotonic() - job.started_at)
            self._gauges()
        if self.metrics is not None:
            self.metrics.finished(finish)
        job._post(job._events.put_nowait, ("error", error) if error is not None else ("end", finish))

/*
 * The recalc queue protocol of spec 000, model-checked.
 *
 * NW writers (API edits: a statement on property_objects or layouts whose trigger enqueues the
 * project) and ND drains (pin_pipelines/recalc/drain.py, one project at a time) share ONE
 * project, i.e. one row of chessboard.project_recalc_requests; a clock process gives time.
 * Each Promela step is one SQL statement, or a statement and its COMMIT, of the objects defined
 * in sql/postgres/schema/ (queue.sql, recalc.sql) and the named queries of
 * sql/postgres/queries/recalc.sql; the comment at each step names the object it stands for
 * (tests/model/test_model_names.py checks that every chessboard.<name> here is defined there).
 * A drain tick is queries/recalc.sql:settle_abandoned_claims, then ONE call of
 * chessboard.recalc_tick, which runs each project in a transaction of its own (a COMMIT per
 * project) and each project's work in a block of its own (a subtransaction): the work is
 * chessboard.recalc_project_step, whose chessboard.recalc_claimed_project is the steps from
 * lock_claimed_request to delete_request (its inner block is the SAVEPOINT, each step labelled
 * there with its name), and which records the outcome before the COMMIT:
 *
 *   writer   BEGIN (now() = t)
 *            UPDATE layouts | property_objects, then its AFTER STATEMENT trigger
 *              (chessboard.hierarchy_raise | chessboard.property_objects_raise)
 *            chessboard.request_project_recalc: INSERT ... ON CONFLICT DO UPDATE (waits for a
 *              held row)
 *            COMMIT
 *   drain    queries/recalc.sql:settle_abandoned_claims (a tick's first statement, autocommit:
 *              a pending end of a claim whose row is free now is written, as below; a claim
 *              unlocked past retry_interval with no pending end is a dead drain's:
 *              attempt_count + 1, claimed_at NULL)
 *            chessboard.recalc_tick: chessboard.claim_due_request; COMMIT (the tick's first
 *              claim alone; each next one commits with the previous project's work)
 *            the block: chessboard.recalc_project_step -> chessboard.recalc_claimed_project:
 *            lock_claimed_request FOR UPDATE (waits, under lock_timeout)
 *              NULL -> "deferred", COMMIT (the claim was settled as abandoned)
 *              lock_timeout -> the block rolls back; recalc_tick's handler:
 *                chessboard.release_claim, COMMIT ("deferred"), and the tick goes on
 *              the statement timeout's cancel -> the block rolls back;
 *                chessboard.record_recalc_timeout (attempt_count + 1, claimed_at NULL), COMMIT
 *                ("failed"), and the drain's tick goes on with its next call
 *              each handler through chessboard.end_claim: a row a writer holds is waited for
 *                a bounded time (or not at all), then its end is left in
 *                chessboard.recalc_pending_claim_ends, COMMIT, and the tick goes on
 *            SAVEPOINT; lock_project FOR NO KEY UPDATE (waits, under lock_timeout)
 *              LockNotAvailable -> ROLLBACK TO SAVEPOINT; chessboard.release_claim; COMMIT
 *              ("deferred")
 *            the recompute (one statement: buildings, layouts, layout groups, project: the read)
 *            delete_request; COMMIT                                       ("recalculated")
 *            or a failing statement (a stuck one's statement timeout included: the inner
 *              block catches it): ROLLBACK TO SAVEPOINT; recalc_project_step's record_failure
 *              (attempt_count + 1, claimed_at NULL); COMMIT                       ("failed")
 *            or a stop's cancel: the block rolls back; chessboard.release_claim (through
 *              chessboard.end_claim, as above); COMMIT; the call ends      ("interrupted")
 *            or death anywhere after the claim: ROLLBACK by the server, the claim stays
 *              (claimed_at) until a tick's settle_abandoned_claims counts it
 *
 * Abstraction.
 *  - Time is a byte of discrete ticks (`now`). The clock ticks only while a comparison with it
 *    can still change: a writer may still begin (now <= WEND), or the row waits for its due_at
 *    or its retry interval. now() is a transaction's start, as in PostgreSQL: a writer takes
 *    t = now at BEGIN and its upsert uses t however long it waited for the row.
 *  - chessboard.recalc_settings are small constants: DEBOUNCE (30 s) = 2, CAP (starvation_cap,
 *    5 min) = 3, RETRY (retry_interval, 5 s) = 1 tick; POISON (poison_attempts) = 5, the real
 *    value. DEBOUNCE <= CAP, as the defaults are.
 *  - claimed_at and attempted_at are the claim's now. attempted_at is the retry clock; claimed_at
 *    marks the attempt in progress and is the claim's identity (lock_claimed_request and
 *    release_claim match on it); with RETRY >= 1 two claims of one row never carry the same
 *    stamp (asserted where a re-lock matches), which PostgreSQL's microsecond timestamps give.
 *  - Row locks are owner variables: qlock (the queue row: the claim's FOR UPDATE, held only
 *    within its atomic step; lock_claimed_request's FOR UPDATE; the upsert, which also holds a
 *    row it INSERTed until its COMMIT) and hlock (the project's projects/buildings/layouts/
 *    layout_groups rows: lock_project against a layout edit's UPDATE). A blocked statement is a
 *    guard. Transactions waiting for the queue row are counted in qwaiters: a waiter holds
 *    PostgreSQL's tuple lock, so FOR UPDATE SKIP LOCKED passes over the row and the freed lock
 *    goes to a waiter, not to a claim. A drain's wait may end by lock_timeout at any moment: it
 *    is half of deadlock_timeout (drain.py), so the drain always gives up before the deadlock
 *    detector would abort the edit; writers wait without limit and never abort.
 *  - Read Committed: lock_claimed_request and release_claim wait for a locked row only when the
 *    version they see matches their WHERE (attempted_at = the claim's); an uncommitted INSERT
 *    (row_new) or a row stamped by another claim is passed over at once (NULL, no update); a
 *    statement that waited evaluates its WHERE on the row as the holder committed it.
 *  - Truth: `committed` counts committed source writes; the recalc statements read
 *    seen = committed (their snapshots; no writer can commit between them, since it needs the
 *    queue row the drain holds: asserted at the commit); the aggregates are right when the last
 *    successful recalc saw every committed write (fresh == committed): they are a pure function
 *    of the source rows, so seeing the last write is seeing them all.
 *  - Faults, bounded so the state space is finite: drains die (OOM kill, lost connection) at
 *    most MAX_DEATHS = 1 times in all and are stopped (SIGTERM, a run's budget: QueryCanceled,
 *    the attempt is given back) at most MAX_STOPS = 1 times; a recalc statement fails any
 *    number of times; the clock ticks while a claim runs (a drain stalled past the retry
 *    interval, which lets another drain settle its claim as abandoned) at most MAX_STALLS = 1
 *    times. A dead drain comes back as a new session.
 *  - A drain with nothing ready waits until a row is ready instead of polling (a poll that finds
 *    nothing changes nothing). With the waiters' priority above, no run can cycle without
 *    progress, so no fairness assumption is needed: `pan -a` without -f checks the LTL formula
 *    on every run, which is stronger than under weak fairness (-f gives the same result at
 *    about ten times the cost: compile with -DNFAIR=3).
 *
 * Where the model differs from the SQL and Python, on purpose:
 *  - one project: the claim's ORDER BY due_at / LIMIT 1, batches, the tick's `attempted`
 *    exclusion (with one project it only ends the tick, and the next tick may claim at once, as
 *    drain_until_idle does) and the raisers' project_id lock order are not exercised;
 *  - WRITES = 1 transaction per writer, of one statement: writer 1 edits a layout (a row
 *    lock_project needs), writer 2 a property object (no row a drain locks); a longer
 *    transaction is the interleavings in which the writer holds its locks before its COMMIT;
 *  - requested_count, last_reason, tenant_id, last_error, updated_at and the counters
 *    (chessboard.record_recalc_outcome, chessboard.fold_recalc_outcomes, the tick's
 *    queries/recalc.sql:count_poisoned) are left out: no protocol step reads them;
 *  - archived or deleted projects (delete_request without a recalc), the runbook's
 *    force_request and requeue_request, writers that roll back, and server crashes (so the
 *    claim's synchronous_commit = off) are not modelled;
 *  - the claim's transaction is one atomic step (a drain dying inside it leaves nothing). A
 *    tick's later claims commit with the previous project's work (chessboard.recalc_tick
 *    claims the next project last in the project's block, with SKIP LOCKED, before its
 *    COMMIT); with one project the next claim is never this row (it excludes the projects the
 *    tick tried), so for this row it is still a claim committed before its work, as modelled,
 *    and the tick's going on after a project ends it. A drain that dies while its call runs
 *    either has the project in hand rolled back (the server sees the client gone:
 *    client_connection_check_interval) or committed as if it died right after the COMMIT, both
 *    modelled;
 *    the recalc's failure points are one choice after the read (a rollback to the savepoint
 *    undoes the same whichever statement failed); a death or a stop is offered at the points
 *    where what it undoes differs (between the claim and the work, in the work, before
 *    release_claim);
 *  - the statement timeout's cancel is offered only while lock_claimed_request waits, at most
 *    MAX_TIMEOUTS = 1 times: elsewhere in the work it is the inner block's "failed" (modelled
 *    as a failing statement), and the other statements (release_claim in
 *    recalc_project_step, the next claim) hold the row or skip it. A cancel that lands in the
 *    handler's wait for the row (chessboard.end_claim) ends the wait as its bound does: the end
 *    is left pending (modelled: a handler that meets a held row may always leave it pending);
 *    one that lands between a COMMIT and the next block ends the call with the error, the claim
 *    in hand left to settle_abandoned_claims: for the row, a death at that point, modelled.
 *  - a pending end (chessboard.recalc_pending_claim_ends) is one per claim, so one variable of
 *    the row's (pend_stamp: the claim it ends, NONE: none); the settle writes it in a step of its
 *    own (the model's settle is one statement per outcome: abandoned, or a pending end).
 *
 * Properties: assertions (the monitor checks them in every state; the rest at their step) and
 * the LTL formula no_trigger_lost.
 *  1. no trigger lost: fresh == committed or the row is queued, in every state; a recalc
 *     commits with the snapshot it read; every final state has every writer done and
 *     fresh == committed or the row poisoned (it stays for triage); LTL
 *     <>[] (all writers done && (fresh == committed || poisoned)), on every run.
 *  2. mutual exclusion: at most one drain between lock_claimed_request and its COMMIT.
 *  3. cap: due_at <= first_requested_at + CAP after every upsert (nothing else writes due_at).
 *  4. poison after exactly POISON failed attempts: attempt_count (failed runs, spec 000) ==
 *     failures - abandoned + settled (failures: attempts that ended without a verdict given
 *     back, i.e. record_failure, record_recalc_timeout, a drain dead after its claim, a claim
 *     settled while its drain was stalled; abandoned: dead drains' claims not settled yet;
 *     settled: stalled drains' claims settled before their drain noticed), never above POISON;
 *     so a row is poisoned (attempt_count >= POISON, no claim outstanding, no attempt running)
 *     exactly when POISON attempts failed; a claim asserts fewer than POISON failures (never
 *     claimed after).
 *
 * Deliberately broken variants (spin must report an error for each):
 *  -DBUG_NO_RELOCK         the work transaction reads the claimed row without FOR UPDATE: a
 *                          request arriving during the recalc is no longer held off, and
 *                          delete_request (unconditional: the lock is what makes it safe)
 *                          deletes it (1, with -DND=1); once RETRY has passed a second drain
 *                          settles the live claim as abandoned (the attempt counted twice: 4)
 *                          and claims the row, working at the same time (2);
 *  -DBUG_NO_CAP            request_project_recalc's update without least(.., first + cap) (3);
 *  -DBUG_CLAIM_NO_LOCK     claim_due_request's CTE without FOR UPDATE SKIP LOCKED: two drains
 *                          both pick the row, and the second UPDATE (it re-checks only
 *                          project_id) overwrites the first claim, whose failed attempt is then
 *                          never counted (4);
 *  -DBUG_RELEASE_UNGUARDED release_claim matching project_id only: a stalled drain whose claim
 *                          was settled gives back another drain's claim, whose attempt is then
 *                          never counted (4);
 *  -DBUG_LEASE_NO_EXPIRY   the claim as a lease without expiry (settle_abandoned_claims left
 *                          out): a drain dying after its claim parks the row for ever,
 *                          unpoisoned (1: the final state, and the LTL run with -A, which
 *                          ignores assertions, finds the acceptance cycle).
 * Reachability probes (-DREACH_<name>: spin must report the probe's assertion, so the checks
 * above are not vacuous): POISON, INSERT_AFTER_WAIT (a request that waited for a recalc
 * inserts a new row), DEFER, SUPERSEDED, RELOCK_TIMEOUT (lock_claimed_request times out on a
 * row a writer upserted after the claim: chessboard.recalc_tick's handler gives the claim back
 * and the tick goes on), TIMEOUT (the statement timeout's cancel in that wait:
 * chessboard.record_recalc_timeout counts the failed run), PENDING_END (a handler met the row
 * held by a writer and left the end pending; a later tick's settle wrote it), DEATH, STOP,
 * FAILURE, and
 * POISON_VIEW_EARLY: chessboard.poisoned_recalc_requests() lists a row counted poison while the
 * drain of its fifth attempt still runs: only once that drain stalled past retry_interval
 * between its claim and its lock, so that another drain settled the claim (the stalled drain
 * then defers); attempt_count counts no attempt before it has failed.
 *
 * Run (tests/model/test_recalc_queue_model.py runs these, and the variants, in a tmp dir):
 *   spin -a model/recalc_queue.pml
 *   cc -O2 -DSAFETY -DNOCLAIM -o pan pan.c && ./pan -m10000    # assertions, final states
 *   cc -O2 -o pan pan.c && ./pan -a -m10000                     # + LTL no_trigger_lost
 *   spin -DBUG_NO_CAP -a model/recalc_queue.pml && ... && spin -DBUG_NO_CAP -t recalc_queue.pml
 *                                             # the counterexample, one line per SQL step
 */

#ifndef NW
#define NW 2            /* writers */
#endif
#ifndef WRITES
#define WRITES 1        /* transactions per writer */
#endif
#ifndef ND
#define ND 2            /* drains */
#endif
#ifndef DEBOUNCE
#define DEBOUNCE 2
#endif
#ifndef CAP
#define CAP 3
#endif
#ifndef RETRY
#define RETRY 1
#endif
#ifndef POISON
#define POISON 5
#endif
#ifndef WEND
#define WEND 2          /* writers begin transactions while now <= WEND */
#endif
#ifndef MAX_DEATHS
#define MAX_DEATHS 1
#endif
#ifndef MAX_STOPS
#define MAX_STOPS 1
#endif
#ifndef MAX_TIMEOUTS
#define MAX_TIMEOUTS 1  /* statement timeouts while lock_claimed_request waits */
#endif
#ifndef MAX_STALLS
#define MAX_STALLS 1    /* clock ticks while a claim of the row is running */
#endif

#define NONE 255            /* attempted_at IS NULL; no claim */
#define MIN(a, b) ((a) < (b) -> (a) : (b))

/* chessboard.project_recalc_requests: the project's row */
bool row;               /* a version of the row exists */
bool row_new;           /* ... and it is an INSERT not yet committed */
byte due_at;
byte first_at;          /* first_requested_at */
byte attempts;          /* attempt_count: failed runs */
byte attempted_at = NONE;
byte claimed_at = NONE; /* the attempt in progress (NONE: none) */
/* chessboard.recalc_pending_claim_ends: the end of the claim pend_stamp (NONE: none) that a
   handler left to the settle, a failed run (pend_failed) or a give-back to pend_prev */
byte pend_stamp = NONE;
byte pend_prev = NONE;
bool pend_failed;

byte qlock;             /* holder of the queue row's lock (0: none) */
byte qwaiters;          /* transactions queued for it (their tuple lock makes SKIP LOCKED skip) */
byte hlock;             /* holder of the project's hierarchy rows' locks */
byte now;

/* ghosts: the model's bookkeeping, read by no SQL step (live and stalls bound the clock) */
byte committed;         /* committed source writes */
byte fresh;             /* committed writes seen by the last successful recalc */
byte failures;          /* attempts of this row incarnation that ended without a verdict given
                           back: failed, dead, or settled while their drain was stalled */
byte live;              /* claims of this row incarnation still running */
byte owner;             /* the drain whose claim claimed_at is (0: its drain died) */
byte abandoned;         /* dead drains' claims not settled yet */
byte settled;           /* stalled drains' claims settled before their drain noticed */
byte settled_of;        /* ... the drain whose claim it is */
byte inc;               /* row incarnation (inserts so far) */
byte in_work;           /* drains inside a work transaction holding the claimed row */
byte deaths;
byte stops;
byte timeouts;
byte stalls;            /* ticks while a claim of the row was running */
byte wdone;             /* writers finished */
short probe_hit;

#define R_INSERT_AFTER_WAIT 1
#define R_DEFER 2
#define R_SUPERSEDED 4
#define R_RELOCK_TIMEOUT 8
#define R_DEATH 16
#define R_STOP 32
#define R_FAILURE 64
#define R_TIMEOUT 128
#define R_PENDING_END 256

#define POISONED (row && attempts >= POISON)
/* no claim outstanding, none running: every attempt of the row has its verdict */
#define QUIET (live == 0 && claimed_at == NONE)
#define ALL_DONE (wdone == NW)

/* a probe marks only its own step: no other bit enters the state vector */
#if defined(REACH_POISON)
#define PROBE (POISONED && QUIET)
#elif defined(REACH_POISON_VIEW_EARLY)
/* chessboard.poisoned_recalc_requests() (attempt_count >= poison_attempts)
   lists the row while the drain of its last attempt still runs, its failure not yet known */
#define PROBE (row && !row_new && attempts >= POISON && failures < POISON)
#elif defined(REACH_INSERT_AFTER_WAIT)
#define PROBE_BIT R_INSERT_AFTER_WAIT
#elif defined(REACH_DEFER)
#define PROBE_BIT R_DEFER
#elif defined(REACH_SUPERSEDED)
#define PROBE_BIT R_SUPERSEDED
#elif defined(REACH_RELOCK_TIMEOUT)
#define PROBE_BIT R_RELOCK_TIMEOUT
#elif defined(REACH_DEATH)
#define PROBE_BIT R_DEATH
#elif defined(REACH_STOP)
#define PROBE_BIT R_STOP
#elif defined(REACH_FAILURE)
#define PROBE_BIT R_FAILURE
#elif defined(REACH_TIMEOUT)
#define PROBE_BIT R_TIMEOUT
#elif defined(REACH_PENDING_END)
#define PROBE_BIT R_PENDING_END
#endif
#ifdef PROBE_BIT
#define PROBE (probe_hit != 0)
#define MARK(b) probe_hit = probe_hit | ((b) & PROBE_BIT)
#else
#define MARK(b) skip
#endif
#ifndef PROBE
#define PROBE false
#endif

/* the end of an attempt: the drain forgets its claim (in the step that ends it) */
#define FORGET stamp = NONE; prev = NONE; myinc = 0; seen = 0; ok = false; timed_out = false

/* claim_due_request's ready CTE on the committed row */
#ifdef BUG_LEASE_NO_EXPIRY
#define RETRY_GATE (attempted_at == NONE)
#else
#define RETRY_GATE (attempted_at == NONE || attempted_at + RETRY <= now)
#endif
#define READY (row && !row_new && due_at <= now && attempts < POISON && claimed_at == NONE && \
               RETRY_GATE)
/* settle_abandoned_claims' abandoned CTE: a claim unlocked (FOR UPDATE SKIP LOCKED: not
   locked, nobody queued for it) past retry_interval, with no pending end */
#ifdef BUG_LEASE_NO_EXPIRY
#define ABANDONED false
#else
#define ABANDONED (row && !row_new && claimed_at != NONE && claimed_at + RETRY <= now && \
                   qlock == 0 && qwaiters == 0 && claimed_at != pend_stamp)
#endif
/* ... and its ending CTE: a pending end whose claim is the row's, the row unlocked */
#define PENDING_END (row && !row_new && pend_stamp != NONE && claimed_at == pend_stamp && \
                     qlock == 0 && qwaiters == 0)

/* time matters while a writer may still begin, or the row waits for due_at or its retry */
#define TIME_MATTERS ((wdone < NW && now <= WEND) || \
    (row && attempts < POISON && \
     (now < due_at || (attempted_at != NONE && now < attempted_at + RETRY))) || \
    (row && claimed_at != NONE && now < claimed_at + RETRY))

/* a statement of the work transaction may write the row: it holds the row (or, without the
 * re-lock of the bug variant, takes it for that statement and the commit) */
#define MAY_WRITE_ROW (qlock == 0 || qlock == me || row_new)
#define UNLOCK_Q \
    if \
    :: qlock == me -> qlock = 0 \
    :: else -> skip \
    fi

/* lock_claimed_request and release_claim (WHERE project_id = .. AND attempted_at = ..) wait
 * only for a row whose version they see matches: one that does not, or an uncommitted INSERT,
 * is passed over at once; while the row is locked its attempted_at is the committed one */
#define SEES_NO_MATCH (row_new || !row || claimed_at != stamp)
#ifdef BUG_RELEASE_UNGUARDED
#define RELEASE_NO_WAIT (qlock == 0 || row_new || !row)
#else
#define RELEASE_NO_WAIT (qlock == 0 || SEES_NO_MATCH)
#endif

/* my claim of this row incarnation is still outstanding, or was settled while I stalled */
#define MINE (row && inc == myinc && claimed_at == stamp)
#define MINE_SETTLED (row && inc == myinc && settled > 0 && settled_of == me)

/* an attempt whose claim is no longer the row's ends: settled while this drain stalled (it is
   counted already), or (only in the broken variants) overwritten or given back by another
   drain, uncounted */
#define END_SUPERSEDED \
    if \
    :: MINE_SETTLED -> failures++; live--; settled--; settled_of = 0 \
    :: !MINE_SETTLED && row && inc == myinc -> failures++; live-- \
    :: else -> skip \
    fi

/* the drain dies: its claim stays (claimed_at) until a tick settles it as abandoned */
#define DIE \
    if \
    :: MINE -> failures++; live--; abandoned++; owner = 0 \
    :: else -> END_SUPERSEDED \
    fi

/* chessboard.release_claim(project_id, claimed_at, previous_attempted_at): gives back this
 * claim (no attempt in progress, the retry clock as before), or nothing when the claim is no
 * longer the row's; the bug variant's SQL does not check the stamp */
#ifdef BUG_RELEASE_UNGUARDED
#define RELEASE \
    if \
    :: row && !row_new && claimed_at == stamp -> live--; owner = 0 \
    :: else -> END_SUPERSEDED \
    fi; \
    if \
    :: row && !row_new -> claimed_at = NONE; attempted_at = prev \
    :: else -> skip \
    fi
#else
#define RELEASE \
    if \
    :: row && !row_new && claimed_at == stamp -> \
       claimed_at = NONE; attempted_at = prev; live--; owner = 0 \
    :: else -> END_SUPERSEDED \
    fi
#endif

/* chessboard.recalc_project_step's record_failure (WHERE project_id = ..: the work transaction
 * holds the claimed row, so it is this claim's; without the re-lock of the bug variant it may
 * not be): one more failed run, no attempt in progress */
#define RECORD_FAILURE \
    if \
    :: MINE -> failures++; live--; owner = 0 \
    :: else -> END_SUPERSEDED \
    fi; \
    if \
    :: row && !row_new -> attempts++; claimed_at = NONE \
    :: else -> skip \
    fi

/* chessboard.record_recalc_timeout (WHERE project_id = .. AND claimed_at = ..: after the
 * block's rollback this transaction holds no row lock, so the claim may have been settled
 * meanwhile): one more failed run, no attempt in progress, the retry clock from the claim */
#define RECORD_TIMEOUT \
    if \
    :: row && !row_new && claimed_at == stamp -> \
       attempts++; claimed_at = NONE; failures++; live--; owner = 0 \
    :: else -> END_SUPERSEDED \
    fi

/* what recalc_tick's handler runs after the block's rollback: record_recalc_timeout matches
 * on claimed_at as the correct release_claim does */
#define GIVE_BACK_NO_WAIT (timed_out -> (qlock == 0 || SEES_NO_MATCH) : RELEASE_NO_WAIT)
#define GIVE_BACK \
    if \
    :: timed_out -> RECORD_TIMEOUT \
    :: else -> RELEASE \
    fi

/* chessboard.end_claim, the row held by a writer past the handler's wait: the claim's end left
 * in chessboard.recalc_pending_claim_ends (the claim stays on the row, live, till the settle);
 * nothing when the claim is no longer the row's (settled while this drain stalled) */
#define PEND \
    if \
    :: MINE -> pend_stamp = stamp; pend_prev = prev; pend_failed = timed_out \
    :: else -> END_SUPERSEDED \
    fi

/* queries/recalc.sql:settle_abandoned_claims' ending CTE: the pending end written, as the
 * handler would have (record_recalc_timeout's failed run, or release_claim's give-back) */
#define SETTLE_PENDING \
    MARK(R_PENDING_END); \
    if \
    :: pend_failed -> attempts++; failures++ \
    :: else -> attempted_at = pend_prev \
    fi; \
    claimed_at = NONE; live--; owner = 0; pend_stamp = NONE; pend_prev = NONE; \
    pend_failed = false; \
    printf("drain %d: settle_abandoned_claims: a pending end, attempt_count %d\n", me, attempts)

/* queries/recalc.sql:settle_abandoned_claims: the claim counted as a failed run, its row free
 * again */
#define SETTLE \
    attempts++; claimed_at = NONE; \
    if \
    :: owner == 0 -> abandoned-- \
    :: else -> assert(settled == 0); settled++; settled_of = owner; owner = 0 \
    fi; \
    printf("drain %d: settle_abandoned_claims: attempt_count %d\n", me, attempts)

/* chessboard.request_project_recalc's INSERT ... ON CONFLICT DO UPDATE, with the row lock in
 * hand */
inline upsert()
{
    qlock = me;
    if
    :: !row ->
       /* no row (never queued, or deleted by a recalc while this waited): INSERT, due_at =
          now() + debounce, first_requested_at = now(); invisible till the COMMIT */
       row = true; row_new = true;
       due_at = t + DEBOUNCE; first_at = t; attempts = 0; attempted_at = NONE; claimed_at = NONE;
       if
       :: waited -> MARK(R_INSERT_AFTER_WAIT)   /* it waited for a recalc that deleted the row */
       :: else -> skip
       fi;
       inc++; failures = 0; live = 0; owner = 0; abandoned = 0; settled = 0; settled_of = 0;
       printf("writer %d: request_project_recalc INSERT: due_at %d, first_requested_at %d\n",
              me, due_at, first_at)
    :: else ->
       /* ON CONFLICT DO UPDATE: due_at = least(now() + debounce, first_requested_at + cap) */
#ifdef BUG_NO_CAP
       due_at = t + DEBOUNCE;
#else
       due_at = MIN(t + DEBOUNCE, first_at + CAP);
#endif
       printf("writer %d: request_project_recalc ON CONFLICT DO UPDATE: due_at %d\n", me, due_at)
    fi;
    assert(due_at <= first_at + CAP)         /* 3: the starvation cap */
}

proctype writer(byte me; bool layout)
{
    byte k;
    byte t;
    bool waited;

    do
    :: atomic {
           k < WRITES && now <= WEND ->
           /* BEGIN: now() is this transaction's start */
           t = now;
           printf("writer %d: BEGIN, now() = %d\n", me, t)
       };
       atomic {
           /* UPDATE chessboard.layouts ... (rows lock_project locks too: it waits for them) or
              UPDATE chessboard.property_objects ... (no row a drain locks) */
           !layout || hlock == 0 ->
           if
           :: layout -> hlock = me; printf("writer %d: UPDATE chessboard.layouts\n", me)
           :: else -> printf("writer %d: UPDATE chessboard.property_objects\n", me)
           fi;
           /* the statement's AFTER trigger (chessboard.hierarchy_raise or
              chessboard.property_objects_raise, through chessboard.enqueue_touched_projects):
              chessboard.request_project_recalc; it waits, queued, for a row lock another
              transaction holds */
           if
           :: qlock == 0 -> upsert(); waited = false
           :: else ->
              qwaiters++; waited = true;
              printf("writer %d: request_project_recalc waits for the queue row (held by %d)\n",
                     me, qlock)
           fi
       };
       if
       :: waited -> atomic { qlock == 0 -> qwaiters--; upsert() }
       :: else -> skip
       fi;
       /* COMMIT: the write and its request become visible together */
       atomic {
           committed++; row_new = false; qlock = 0;
           printf("writer %d: COMMIT (committed writes: %d)\n", me, committed);
           if
           :: layout -> hlock = 0
           :: else -> skip
           fi;
           k++; t = 0; waited = false
       }
    :: else -> break
    od;
    wdone++
}

/* chessboard.recalc_claimed_project's lock_claimed_request(project_id, claimed_at), once the
   row is free (or only an invisible INSERT holds it): this claim's row, locked till the end;
   or NULL: "deferred", COMMIT, the claim is not given back (it was superseded by another
   drain's claim, or recalculated) */
inline relocked()
{
    if
    :: row && !row_new && claimed_at == stamp ->
       assert(inc == myinc);                 /* the stamp identifies the claim */
#ifndef BUG_NO_RELOCK
       qlock = me;
#endif
       in_work++;
       printf("drain %d: lock_claimed_request: the row is this claim's\n", me)
    :: else ->
       if
       :: row && inc == myinc -> MARK(R_SUPERSEDED)
       :: else -> skip
       fi;
       END_SUPERSEDED;
       printf("drain %d: lock_claimed_request: NULL, deferred (the claim was settled)\n", me);
       FORGET;
       goto end_tick
    fi
}

/* chessboard.claim_due_request: stamped (claimed_at, attempted_at), nothing counted */
inline claim()
{
    assert(attempts < POISON && failures < POISON);  /* 4: never claimed after poison */
    prev = attempted_at; stamp = now; attempted_at = now; claimed_at = now; owner = me;
    live++; myinc = inc;
    printf("drain %d: claim_due_request; COMMIT: claimed_at %d (attempt_count %d)\n",
           me, stamp, attempts)
}

proctype drain(byte me)
{
    byte stamp = NONE;  /* the claim's attempted_at */
    byte prev = NONE;   /* its previous_attempted_at */
    byte myinc;
    byte seen;
    bool ok;
    bool timed_out;     /* the wait for the claimed row ended by the statement timeout */

end_tick:
    /* a tick: queries/recalc.sql:settle_abandoned_claims, then CALL chessboard.recalc_tick */
#ifdef BUG_CLAIM_NO_LOCK
    /* the ready CTE as a plain read; then the UPDATE ... FROM ready waits for the row lock and
       re-checks only r.project_id = ready.project_id */
    atomic {
        if
        :: READY -> ok = true
        :: ABANDONED -> SETTLE; goto end_tick
        :: PENDING_END -> SETTLE_PENDING; goto end_tick
        fi
    };
    if
    :: ok ->
       atomic {
           (qlock == 0 || row_new) ->
           if
           :: row && !row_new -> claim()
           :: else -> ok = false
           fi
       }
    :: else -> skip
    fi;
    if
    :: !ok -> goto end_tick
    :: else -> skip
    fi;
    if
    :: atomic {
           deaths < MAX_DEATHS -> deaths++; MARK(R_DEATH); DIE;
           printf("drain %d dies before its work transaction\n", me);
           FORGET; goto end_tick
       }
    :: true -> skip
    fi;
#else
    /* chessboard.recalc_tick's first claim, chessboard.claim_due_request, in its own
       transaction (synchronous_commit off; the UPDATE of the row its CTE locked FOR UPDATE SKIP
       LOCKED, which passes over a row locked or waited for; COMMIT) */
    atomic {
        if
        :: ABANDONED ->
           /* queries/recalc.sql:settle_abandoned_claims (each tick runs it first; it changes
              the row only when a claim is abandoned, so here it is a step of its own) */
           SETTLE; goto end_tick
        :: PENDING_END -> SETTLE_PENDING; goto end_tick
        :: READY && qlock == 0 && qwaiters == 0 -> claim()
        :: READY && qlock == 0 && qwaiters == 0 && deaths < MAX_DEATHS ->
           /* ... and the drain dies before its work transaction: the claim stays */
           claim(); deaths++; MARK(R_DEATH); DIE;
           printf("drain %d dies before its work transaction\n", me);
           FORGET; goto end_tick
        fi                          /* (nothing ready: the drain polls; here it waits) */
    };
#endif

    /* the project's block in chessboard.recalc_tick: chessboard.recalc_project_step, whose
       chessboard.recalc_claimed_project begins with lock_claimed_request ... FOR UPDATE */
#ifdef BUG_NO_RELOCK
    atomic { relocked() };
#else
    atomic {
        if
        :: qlock == 0 || SEES_NO_MATCH -> relocked(); ok = true
        :: else ->
           qwaiters++; ok = false;
           printf("drain %d: lock_claimed_request waits for the row (held by %d)\n", me, qlock)
        fi
    };
    if
    :: ok -> skip
    :: atomic { !ok && (qlock == 0 || SEES_NO_MATCH) -> qwaiters--; relocked() }
    :: atomic {
           !ok ->
           /* lock_timeout (lock_not_available), or a stop's cancel, while another transaction
              holds the row: the block rolls back and chessboard.recalc_tick's handler gives
              the claim back ("deferred": the tick goes on; "interrupted": the call ends) */
           qwaiters--;
           if
           :: qlock != 0 && qlock <= NW -> MARK(R_RELOCK_TIMEOUT)    /* a writer holds it */
           :: else -> skip
           fi;
           printf("drain %d: lock_claimed_request: lock_timeout, the block rolls back\n", me)
       };
       goto give_back
    :: atomic {
           !ok && timeouts < MAX_TIMEOUTS ->
           /* the statement timeout's cancel (the call has run past it): the block rolls back
              and chessboard.recalc_tick's handler counts the failed run */
           qwaiters--; timeouts++; timed_out = true; MARK(R_TIMEOUT);
           printf("drain %d: lock_claimed_request: statement timeout, the block rolls back\n",
                  me)
       };
       goto give_back
    fi;
#endif

    /* chessboard.recalc_claimed_project's inner block (the SAVEPOINT): lock_project (project,
       buildings, layouts, layout groups FOR NO KEY UPDATE), then the recompute, one statement
       on one Read Committed snapshot (no writer can commit meanwhile: it needs the queue row) */
    if
#ifdef BUG_NO_RELOCK
    :: atomic { hlock == 0 -> hlock = me };
       atomic { seen = committed; printf("drain %d: the recompute reads %d writes\n", me, seen) }
#else
    :: atomic {
           hlock == 0 -> hlock = me; seen = committed;
           printf("drain %d: lock_project; the recompute reads %d writes\n", me, seen)
       }
#endif
    :: atomic {
           hlock != 0 && MAY_WRITE_ROW ->
           /* LockNotAvailable: ROLLBACK TO SAVEPOINT; chessboard.recalc_project_step's
              chessboard.release_claim (the row still locked by this transaction); COMMIT:
              "deferred", no attempt counted */
           MARK(R_DEFER);
           RELEASE; in_work--; UNLOCK_Q;
           printf("drain %d: lock_project: LockNotAvailable; release_claim; COMMIT\n", me);
           FORGET; goto end_tick
       }
    fi;

    if
    :: atomic {
           MAY_WRITE_ROW ->
           /* delete_request (unconditional); chessboard.record_recalc_outcome; COMMIT */
           assert(seen == committed);        /* 1: nothing committed during the recalc */
           if
           :: row && !row_new ->
              row = false; due_at = 0; first_at = 0; attempts = 0; attempted_at = NONE;
              claimed_at = NONE; owner = 0
           :: else -> skip
           fi;
           if
           :: seen > fresh -> fresh = seen
           :: else -> skip
           fi;
           in_work--; hlock = 0; UNLOCK_Q;
           printf("drain %d: delete_request; COMMIT\n", me);
           FORGET; goto end_tick
       }
    :: atomic {
           MAY_WRITE_ROW ->
           /* a statement fails (or a stuck one's statement timeout): ROLLBACK TO SAVEPOINT
              (releases the hierarchy rows); record_failure (the queue row still locked);
              chessboard.record_recalc_outcome; COMMIT */
           MARK(R_FAILURE);
           RECORD_FAILURE; hlock = 0; in_work--; UNLOCK_Q;
           printf("drain %d: a recalc fails: ROLLBACK TO SAVEPOINT; record_failure; COMMIT\n",
                  me);
           FORGET; goto end_tick
       }
    :: atomic {
           deaths < MAX_DEATHS ->
           /* the drain dies: the work rolls back, the claim stays till a tick settles it */
           deaths++; MARK(R_DEATH);
           hlock = 0; UNLOCK_Q; in_work--; DIE;
           printf("drain %d dies in its work transaction\n", me);
           FORGET; goto end_tick
       }
    :: atomic {
           stops < MAX_STOPS ->
           /* a stop: the drain cancels the call after the grace; recalc_claimed_project
              raises it on, the block rolls back */
           stops++; MARK(R_STOP); hlock = 0; UNLOCK_Q; in_work--;
           printf("drain %d: stopped: QueryCanceled, the block rolls back\n", me)
       };
       goto give_back
    fi;

give_back:
    /* chessboard.recalc_tick's handler, after the block's rollback: chessboard.release_claim,
       or chessboard.record_recalc_timeout after the statement timeout, through
       chessboard.end_claim: the row written at once when free; when held, waited for within
       the handler's bound (queued) or its end left pending for a later tick's settle; then the
       tick's COMMIT */
    if
    :: atomic {
           deaths < MAX_DEATHS -> deaths++; MARK(R_DEATH); DIE;
           printf("drain %d dies before its claim is given back\n", me);
           FORGET
       }
    :: atomic {
           GIVE_BACK_NO_WAIT -> GIVE_BACK;
           printf("drain %d: release_claim | record_recalc_timeout: claimed_at %d\n",
                  me, claimed_at);
           FORGET
       }
    :: atomic { !GIVE_BACK_NO_WAIT -> qwaiters++ };
       if
       :: atomic {
              GIVE_BACK_NO_WAIT -> qwaiters--; GIVE_BACK;
              printf("drain %d: release_claim | record_recalc_timeout: claimed_at %d\n",
                     me, claimed_at);
              FORGET
          }
       :: atomic {
              /* end_claim's wait ends (its bound, or a cancel) while the row is still held */
              !GIVE_BACK_NO_WAIT -> qwaiters--; PEND;
              printf("drain %d: end_claim: the row held, the end left pending\n", me);
              FORGET
          }
       fi
    :: atomic {
           !GIVE_BACK_NO_WAIT -> PEND;
           printf("drain %d: end_claim: the row held, the end left pending\n", me);
           FORGET
       }
    fi;
    goto end_tick
}

proctype clock()
{
end_clock:
    do
    :: d_step {
           TIME_MATTERS && (live == 0 || stalls < MAX_STALLS) ->
           if
           :: live > 0 -> stalls++
           :: else -> skip
           fi;
           now++;
           assert(now < NONE - CAP - DEBOUNCE);
           printf("clock: now %d\n", now)
       }
    od
}

/* the properties, checked in every state the monitor can observe (between atomic steps) */
proctype monitor()
{
end_monitor:
    atomic {
        !(fresh == committed || (row && !row_new)) ||
        !(in_work <= 1) ||
        !(!row || (attempts + abandoned == failures + settled && attempts <= POISON)) ||
        !(!(POISONED && QUIET) || failures == POISON) ||
        PROBE ->
        assert(fresh == committed || (row && !row_new));     /* 1: no trigger lost */
        assert(in_work <= 1);                                /* 2: mutual exclusion */
        assert(!row || (attempts + abandoned == failures + settled && attempts <= POISON)); /* 4 */
        assert(!(POISONED && QUIET) || failures == POISON);                  /* 4 */
        assert(!PROBE)                                       /* a probe: reachable */
    }
}

/* every run ends (idle drains wait for a ready row, the clock stops once time no longer
 * matters): in the final state every writer is done, nothing is locked or waited for, and the
 * last write was recalculated or the row is poisoned (the LTL formula says the same of every
 * infinite run, and that there is none that cycles without getting there) */
proctype final()
{
end_final:
    timeout ->
    assert(ALL_DONE && qlock == 0 && qwaiters == 0 && hlock == 0 && in_work == 0);
    assert(fresh == committed || POISONED)
}

init
{
    byte i;

    atomic {
        i = 1;
        do
        :: i <= NW -> run writer(i, i == 1); i++   /* writer 1 edits a layout */
        :: i > NW && i <= NW + ND -> run drain(i); i++
        :: else -> break
        od;
        run clock();
        run monitor();
        run final();
        i = 0
    }
}

ltl no_trigger_lost { <> [] (ALL_DONE && (fresh == committed || POISONED)) }

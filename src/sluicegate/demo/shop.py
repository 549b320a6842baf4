"""The embedded demo's data: a small shop schema, a fast server-side bulk loader and a live writer.

The schema deliberately covers awkward cases for replication: an ENUM column, ``text[]`` and
``jsonb`` columns, large (out-of-line TOASTed) text values and a composite primary key on a
table whose name needs quoting (``"Order Items"``).
"""

from __future__ import annotations

import random
import threading

import psycopg
from psycopg import sql

TABLES: tuple[str, ...] = ("customers", "products", "orders", "Order Items")
STATUSES: tuple[str, ...] = ("new", "paid", "shipped", "cancelled")

_DDL = [
    "DROP TABLE IF EXISTS {items}, orders, products, customers",
    "DROP TYPE IF EXISTS order_status",
    "CREATE TYPE order_status AS ENUM ('new', 'paid', 'shipped', 'cancelled')",
    ("CREATE TABLE customers (id bigint PRIMARY KEY, name text, email text, country text,"
     " created_at timestamptz, balance numeric(12,2))"),
    ("CREATE TABLE products (sku text PRIMARY KEY, title text, description text,"
     " price numeric(10,2), tags text[], attrs jsonb)"),
    ("CREATE TABLE orders (id bigint PRIMARY KEY, customer_id bigint, status order_status,"
     " placed_at timestamptz, total numeric(12,2))"),
    ("CREATE TABLE {items} (order_id bigint, line_no int, sku text, qty int, price numeric(10,2),"
     " PRIMARY KEY (order_id, line_no))"),
]

# Per-row pseudo-random numbers: non-negative bigints derived from (row number, seed) only, so the
# data is identical for a seed whatever the plan or session state.
_HASHES = sql.SQL(
    "FROM generate_series(1::bigint, %(n)s::bigint) i, LATERAL (SELECT"
    " hashtextextended(i::text || 'a', %(s)s::bigint) & 9223372036854775807 AS a,"
    " hashtextextended(i::text || 'b', %(s)s::bigint) & 9223372036854775807 AS b,"
    " hashtextextended(i::text || 'c', %(s)s::bigint) & 9223372036854775807 AS c) h"
)

_LOAD = {
    "customers": "INSERT INTO customers (id, name, email, country, created_at, balance)"
    " SELECT i, 'Customer ' || substr(md5(i::text || %(s)s::text), 1, 10),"
    " 'user' || i || '@' || (ARRAY['example.com', 'shop.test', 'mail.test'])[1 + h.a %% 3],"
    " (ARRAY['DE', 'FR', 'US', 'GB', 'JP', 'BR', 'IN', 'NL'])[1 + h.b %% 8],"
    " timestamptz '2023-01-01 00:00:00+00' + make_interval(secs => h.c %% 63072000),"
    " round((h.a %% 1000000) / 100.0 - 2000, 2) {hashes}",
    # every 10th product gets a 10-40 KB description of incompressible hex, stored out of line
    "products": "INSERT INTO products (sku, title, description, price, tags, attrs)"
    " SELECT 'SKU-' || lpad(i::text, 6, '0'), 'Product ' || substr(md5(i::text || %(s)s::text), 1, 8),"
    " CASE WHEN i %% 10 = 1 THEN (SELECT string_agg(md5(i || ':' || j || ':' || %(s)s::text), '')"
    " FROM generate_series(1, 320 + h.a %% 930) j) ELSE 'Short description of product ' || i END,"
    " round(1 + (h.b %% 100000) / 100.0, 2), ARRAY['tag' || h.c %% 20, 'tag' || h.a %% 17],"
    " jsonb_build_object('color', (ARRAY['red', 'green', 'blue', 'black'])[1 + h.b %% 4],"
    " 'weight_g', h.c %% 5000, 'in_stock', h.a %% 3 <> 0) {hashes}",
    "orders": "INSERT INTO orders (id, customer_id, status, placed_at, total)"
    " SELECT i, 1 + h.a %% %(nc)s::bigint, (%(st)s::order_status[])[1 + h.b %% 4],"
    " timestamptz '2024-01-01 00:00:00+00' + make_interval(secs => h.c %% 31536000),"
    " round((h.a %% 5000000) / 100.0, 2) {hashes}",
    # item k belongs to order 1 + (k-1) %% n_orders, line 1 + (k-1) / n_orders: unique composite keys
    "Order Items": "INSERT INTO {items} (order_id, line_no, sku, qty, price)"
    " SELECT 1 + (i - 1) %% %(no)s::bigint, 1 + (i - 1) / %(no)s::bigint,"
    " 'SKU-' || lpad((1 + h.a %% %(np)s::bigint)::text, 6, '0'), 1 + h.b %% 5,"
    " round(1 + (h.c %% 100000) / 100.0, 2) {hashes}",
}


def create_schema(conn: psycopg.Connection) -> None:
    """(Re)create the demo tables and the ``order_status`` type in schema public."""
    with conn.transaction(), conn.cursor() as cur:
        for stmt in _DDL:
            cur.execute(sql.SQL(stmt).format(items=sql.Identifier("Order Items")))


def load(conn: psycopg.Connection, *, rows: int = 200_000, seed: int = 7) -> dict[str, int]:
    """Fill the (empty) tables with >= ``rows`` rows in total, deterministically for ``seed``."""
    n = {"customers": max(1, rows // 10), "products": max(1, rows // 50), "orders": max(1, rows // 4)}
    n["Order Items"] = max(1, rows - sum(n.values()))
    params = {"s": seed, "st": list(STATUSES), "nc": n["customers"], "np": n["products"], "no": n["orders"]}
    with conn.transaction(), conn.cursor() as cur:
        for table in TABLES:
            stmt = sql.SQL(_LOAD[table]).format(hashes=_HASHES, items=sql.Identifier("Order Items"))
            cur.execute(stmt, {**params, "n": n[table]})
    with conn.cursor() as cur:
        for table in TABLES:
            cur.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(table)))
    if not conn.autocommit:
        conn.commit()
    return table_counts(conn)


def table_counts(conn: psycopg.Connection) -> dict[str, int]:
    with conn.cursor() as cur:
        out = {}
        for table in TABLES:
            cur.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table)))
            out[table] = cur.fetchone()[0]
    return out


class LiveWriter(threading.Thread):
    """Keeps writing small mixed transactions into the demo tables until stopped."""

    def __init__(self, url: str, *, seed: int = 11, pause: float = 0.005, max_ops: int | None = None):
        super().__init__(name="sluicegate-demo-writer", daemon=True)
        self.url, self.pause, self.max_ops = url, pause, max_ops
        self.rng = random.Random(seed)
        self.ops = 0
        self.transactions = 0
        self.rollbacks = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=False, application_name=self.name) as conn:
                with conn.cursor() as cur:
                    cur.execute("SELECT coalesce(max(id), 0) FROM customers")
                    self.next_customer = cur.fetchone()[0] + 1
                    cur.execute("SELECT coalesce(max(id), 0) FROM orders")
                    self.next_order = cur.fetchone()[0] + 1
                    cur.execute("SELECT count(*) FROM products")
                    self.n_products = cur.fetchone()[0]
                conn.commit()
                while not self._halt.is_set():
                    if self.max_ops is not None and self.ops >= self.max_ops:
                        break
                    self._transaction(conn)
                    self._halt.wait(self.pause)
        except BaseException as exc:  # noqa: BLE001 - kept for the owner to inspect; the thread ends
            self.error = exc
        finally:
            self._halt.set()

    def _transaction(self, conn: psycopg.Connection) -> None:
        rng = self.rng
        next_c, next_o = self.next_customer, self.next_order
        n_ops = rng.randint(1, 5)
        with conn.cursor() as cur:
            for _ in range(n_ops):
                self._op(cur, rng.random())
        if rng.random() < 0.07:
            conn.rollback()
            self.next_customer, self.next_order = next_c, next_o  # keys were not used after all
            self.rollbacks += 1
        else:
            conn.commit()
            self.ops += n_ops
            self.transactions += 1

    def _op(self, cur: psycopg.Cursor, r: float) -> None:
        rng = self.rng
        items = sql.Identifier("Order Items")
        sku = f"SKU-{rng.randint(1, max(1, self.n_products)):06d}"
        if r < 0.25:  # a new order with 1-3 items
            oid, self.next_order = self.next_order, self.next_order + 1
            cur.execute(
                "INSERT INTO orders (id, customer_id, status, placed_at, total)"
                " VALUES (%s, %s, 'new', now(), %s)",
                (oid, rng.randint(1, self.next_customer - 1 or 1), round(rng.uniform(1, 500), 2)),
            )
            for line in range(1, rng.randint(1, 3) + 1):
                cur.execute(
                    sql.SQL("INSERT INTO {} (order_id, line_no, sku, qty, price) VALUES (%s, %s, %s, %s, %s)")
                    .format(items), (oid, line, sku, rng.randint(1, 5), round(rng.uniform(1, 100), 2)))
        elif r < 0.35:  # a new customer
            cid, self.next_customer = self.next_customer, self.next_customer + 1
            cur.execute(
                "INSERT INTO customers (id, name, email, country, created_at, balance)"
                " VALUES (%s, %s, %s, %s, now(), 0)",
                (cid, f"Customer {cid}", f"user{cid}@live.test", rng.choice(["DE", "FR", "US", "JP"])),
            )
        elif r < 0.55:
            cur.execute("UPDATE orders SET status = %s::order_status WHERE id = %s",
                        (rng.choice(STATUSES), rng.randint(1, self.next_order - 1 or 1)))
        elif r < 0.70:
            cur.execute("UPDATE customers SET balance = balance + %s WHERE id = %s",
                        (round(rng.uniform(-50, 50), 2), rng.randint(1, self.next_customer - 1 or 1)))
        elif r < 0.75:  # rewrite a description, sometimes with a new large (TOASTed) value
            big = rng.random() < 0.5
            text = rng.randbytes(rng.randint(5_000, 20_000)).hex() if big else f"Updated {rng.random()!r}"
            cur.execute("UPDATE products SET description = %s WHERE sku = %s", (text, sku))
        elif r < 0.85:  # leaves the TOASTed description untouched: it must replicate unchanged
            cur.execute("UPDATE products SET price = price + 0.01,"
                        " attrs = attrs || jsonb_build_object('seen', now()) WHERE sku = %s", (sku,))
        elif r < 0.95:  # drop the items of some cancelled order
            cur.execute(sql.SQL("DELETE FROM {} WHERE order_id = (SELECT id FROM orders WHERE"
                                " status = 'cancelled' AND id >= %s ORDER BY id LIMIT 1)").format(items),
                        (rng.randint(1, self.next_order - 1 or 1),))
        else:
            cur.execute("DELETE FROM customers WHERE id = %s", (rng.randint(1, self.next_customer - 1 or 1),))

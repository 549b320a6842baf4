from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Record(_message.Message):
    __slots__ = ("values", "nulls", "unchanged", "binary")
    class BinaryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NULLS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    BINARY_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    nulls: _containers.RepeatedScalarFieldContainer[int]
    unchanged: _containers.RepeatedScalarFieldContainer[int]
    binary: _containers.ScalarMap[int, bytes]
    def __init__(self, values: _Optional[_Iterable[str]] = ..., nulls: _Optional[_Iterable[int]] = ..., unchanged: _Optional[_Iterable[int]] = ..., binary: _Optional[_Mapping[int, bytes]] = ...) -> None: ...

class Column(_message.Message):
    __slots__ = ("name", "type_oid", "typmod", "key")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_OID_FIELD_NUMBER: _ClassVar[int]
    TYPMOD_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    name: str
    type_oid: int
    typmod: int
    key: bool
    def __init__(self, name: _Optional[str] = ..., type_oid: _Optional[int] = ..., typmod: _Optional[int] = ..., key: _Optional[bool] = ...) -> None: ...

class TableHeader(_message.Message):
    __slots__ = ("schema", "name", "columns", "replica_identity")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    schema: str
    name: str
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    replica_identity: str
    def __init__(self, schema: _Optional[str] = ..., name: _Optional[str] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., replica_identity: _Optional[str] = ...) -> None: ...

class RowChange(_message.Message):
    __slots__ = ("before", "after")
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    before: Record
    after: Record
    def __init__(self, before: _Optional[_Union[Record, _Mapping]] = ..., after: _Optional[_Union[Record, _Mapping]] = ...) -> None: ...

class Statement(_message.Message):
    __slots__ = ("type", "table", "rows", "statement_id", "segment_id", "end_segment", "subtransaction_id", "truncated", "cascade", "restart_identity", "start_position", "ddl")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[Statement.Type]
        INSERT: _ClassVar[Statement.Type]
        UPDATE: _ClassVar[Statement.Type]
        DELETE: _ClassVar[Statement.Type]
        TRUNCATE: _ClassVar[Statement.Type]
        ROLLBACK: _ClassVar[Statement.Type]
        ROLLBACK_STATEMENT: _ClassVar[Statement.Type]
        SCHEMA_CHANGE: _ClassVar[Statement.Type]
        DDL: _ClassVar[Statement.Type]
    TYPE_UNSPECIFIED: Statement.Type
    INSERT: Statement.Type
    UPDATE: Statement.Type
    DELETE: Statement.Type
    TRUNCATE: Statement.Type
    ROLLBACK: Statement.Type
    ROLLBACK_STATEMENT: Statement.Type
    SCHEMA_CHANGE: Statement.Type
    DDL: Statement.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    END_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SUBTRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    CASCADE_FIELD_NUMBER: _ClassVar[int]
    RESTART_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    DDL_FIELD_NUMBER: _ClassVar[int]
    type: Statement.Type
    table: TableHeader
    rows: _containers.RepeatedCompositeFieldContainer[RowChange]
    statement_id: int
    segment_id: int
    end_segment: bool
    subtransaction_id: int
    truncated: _containers.RepeatedCompositeFieldContainer[TableHeader]
    cascade: bool
    restart_identity: bool
    start_position: int
    ddl: DdlStatement
    def __init__(self, type: _Optional[_Union[Statement.Type, str]] = ..., table: _Optional[_Union[TableHeader, _Mapping]] = ..., rows: _Optional[_Iterable[_Union[RowChange, _Mapping]]] = ..., statement_id: _Optional[int] = ..., segment_id: _Optional[int] = ..., end_segment: _Optional[bool] = ..., subtransaction_id: _Optional[int] = ..., truncated: _Optional[_Iterable[_Union[TableHeader, _Mapping]]] = ..., cascade: _Optional[bool] = ..., restart_identity: _Optional[bool] = ..., start_position: _Optional[int] = ..., ddl: _Optional[_Union[DdlStatement, _Mapping]] = ...) -> None: ...

class TableName(_message.Message):
    __slots__ = ("schema", "name")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    schema: str
    name: str
    def __init__(self, schema: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class DdlStatement(_message.Message):
    __slots__ = ("tag", "sql", "search_path", "tables")
    TAG_FIELD_NUMBER: _ClassVar[int]
    SQL_FIELD_NUMBER: _ClassVar[int]
    SEARCH_PATH_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tag: str
    sql: str
    search_path: str
    tables: _containers.RepeatedCompositeFieldContainer[TableName]
    def __init__(self, tag: _Optional[str] = ..., sql: _Optional[str] = ..., search_path: _Optional[str] = ..., tables: _Optional[_Iterable[_Union[TableName, _Mapping]]] = ...) -> None: ...

class TransactionContext(_message.Message):
    __slots__ = ("source_id", "transaction_id", "position", "commit_position", "start_time_us", "end_time_us", "origin", "streamed")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSACTION_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COMMIT_POSITION_FIELD_NUMBER: _ClassVar[int]
    START_TIME_US_FIELD_NUMBER: _ClassVar[int]
    END_TIME_US_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    transaction_id: int
    position: int
    commit_position: int
    start_time_us: int
    end_time_us: int
    origin: str
    streamed: bool
    def __init__(self, source_id: _Optional[str] = ..., transaction_id: _Optional[int] = ..., position: _Optional[int] = ..., commit_position: _Optional[int] = ..., start_time_us: _Optional[int] = ..., end_time_us: _Optional[int] = ..., origin: _Optional[str] = ..., streamed: _Optional[bool] = ...) -> None: ...

class Transaction(_message.Message):
    __slots__ = ("context", "statements", "segment_id", "end_segment")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STATEMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    END_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    context: TransactionContext
    statements: _containers.RepeatedCompositeFieldContainer[Statement]
    segment_id: int
    end_segment: bool
    def __init__(self, context: _Optional[_Union[TransactionContext, _Mapping]] = ..., statements: _Optional[_Iterable[_Union[Statement, _Mapping]]] = ..., segment_id: _Optional[int] = ..., end_segment: _Optional[bool] = ...) -> None: ...

class VStreamRequest(_message.Message):
    __slots__ = ("client_id", "position", "tables", "threshold", "streaming")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    position: int
    tables: _containers.RepeatedScalarFieldContainer[str]
    threshold: int
    streaming: bool
    def __init__(self, client_id: _Optional[str] = ..., position: _Optional[int] = ..., tables: _Optional[_Iterable[str]] = ..., threshold: _Optional[int] = ..., streaming: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("position", "time_us")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TIME_US_FIELD_NUMBER: _ClassVar[int]
    position: int
    time_us: int
    def __init__(self, position: _Optional[int] = ..., time_us: _Optional[int] = ...) -> None: ...

class VStreamResponse(_message.Message):
    __slots__ = ("transaction", "heartbeat")
    TRANSACTION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    transaction: Transaction
    heartbeat: Heartbeat
    def __init__(self, transaction: _Optional[_Union[Transaction, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

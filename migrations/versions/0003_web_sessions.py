"""Dashboard sessions: the login cookie holds a session token whose sha256 is stored here, not the API key.

Revision ID: 0003_web_sessions
Revises: 0002
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

TS = sa.DateTime(timezone=True)

revision = '0003_web_sessions'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('web_sessions',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('api_key_id', sa.String(length=64), nullable=False),
    sa.Column('created_at', TS, nullable=False),
    sa.Column('expires_at', TS, nullable=False),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], name=op.f('fk_web_sessions_api_key_id_api_keys'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_web_sessions'))
    )
    op.create_index(op.f('ix_web_sessions_api_key_id'), 'web_sessions', ['api_key_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_web_sessions_api_key_id'), table_name='web_sessions')
    op.drop_table('web_sessions')

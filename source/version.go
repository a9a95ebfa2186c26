package source

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// minServerVersion is the oldest PostgreSQL walrelay supports, as
// server_version_num: 14, the oldest release the version matrix (`make
// test-pg`) tests. Older servers are refused at setup.
const minServerVersion = 140000

// checkServerVersion refuses a server older than minServerVersion.
func checkServerVersion(ctx context.Context, conn *pgx.Conn) error {
	var num int
	var version string
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int, current_setting('server_version')").Scan(&num, &version); err != nil {
		return fmt.Errorf("read the server's version: %w", err)
	}
	return versionError(num, version)
}

// versionError is the refusal of server version num (server_version
// version), or nil.
func versionError(num int, version string) error {
	if num >= minServerVersion {
		return nil
	}
	return setupErrorf("PostgreSQL %s is older than %d, the oldest version walrelay supports: upgrade the server to PostgreSQL %d or later", version, minServerVersion/10000, minServerVersion/10000)
}
